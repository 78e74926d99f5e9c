"""Translation of database errors into ckstore errors at the index boundary.

Everything a database driver can raise out of an index call becomes a ckstore error here:
SQLAlchemy's wrapped errors, raw ``sqlite3`` errors raised in connection hooks (before SQLAlchemy
wraps anything), ``UnicodeDecodeError`` (SQLite returning text, or even an error message, that
is not UTF-8: a damaged page), ``OverflowError`` (a Python int past SQLite's 64-bit INTEGER) and
rows that do not decode (:class:`RowError`, raised by ``_convert``).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError

from ckstore.errors import (
    ConflictError,
    IndexCorruptionError,
    IndexError_,
    InvalidInputError,
    NoSpaceError,
    NotFoundError,
    ReadOnlyStoreError,
)
from ckstore.index._convert import RowError

_SQLITE_READONLY = 8
_SQLITE_FULL = 13
_READ_ONLY_WORDS = ("readonly database", "read-only transaction")
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_CORRUPT_WORDS = ("malformed", "not a database", "could not decode to utf-8")
_NO_DATABASE = re.compile(r'database "([^"]+)" does not exist')


@contextmanager
def translated(what: str, url: str) -> Iterator[None]:
    """Re-raises database errors raised inside the block as ckstore errors.

    Args:
        what: The operation, for the message (``"commit snapshot abc"``).
        url: The index URL (password hidden), for the message.

    Raises:
        IndexCorruptionError: The database file is damaged (SQLite reports corruption, returns
            text that is not UTF-8, or a row does not decode); the message says how to rebuild.
        InvalidInputError: A number is outside the 64-bit integer range the index stores.
        ConflictError: For integrity violations (a concurrent writer took a name or id).
        ReadOnlyStoreError: The database refused a write because it is read-only.
        NotFoundError: For a PostgreSQL database that does not exist (the message says how
            to create it).
        IndexError_: For every other database failure (unreachable, locked, broken).
    """
    try:
        yield
    except IntegrityError as exc:
        raise ConflictError(
            f"{what}: a concurrent change conflicts ({_first_line(exc)}); retry"
        ) from exc
    except (DBAPIError, sqlite3.Error) as exc:
        orig = exc.orig if isinstance(exc, DBAPIError) else exc
        if _is_corruption(orig):
            raise IndexCorruptionError(damaged_message(what, url, _first_line(exc))) from exc
        if _is_full(orig):
            raise NoSpaceError(
                f"cannot {what}: the disk holding the index {url} is full ({_first_line(exc)}); "
                "the transaction was rolled back, so nothing was committed (no snapshot, no tag "
                "change); once some space is free, `ckstore gc` reclaims what an interrupted take "
                "wrote (with --grace 0s, at once when no other take or restore is running), then "
                "try again"
            ) from exc
        if _is_read_only(orig):
            raise ReadOnlyStoreError(
                f"cannot {what}: the index database {url} is read-only ({_first_line(exc)}); "
                "open the store read-only to read it, or a writable copy to change it"
            ) from exc
        if isinstance(exc, OperationalError):
            missing = _NO_DATABASE.search(_first_line(exc))
            if missing:
                raise NotFoundError(_create_database_hint(what, url, missing.group(1))) from exc
            raise IndexError_(
                f"{what}: the index database {url} failed: {_first_line(exc)}"
            ) from exc
        raise IndexError_(f"{what}: index error on {url}: {_first_line(exc)}") from exc
    except SQLAlchemyError as exc:
        raise IndexError_(f"{what}: index error on {url}: {_first_line(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise IndexCorruptionError(
            damaged_message(what, url, f"it returned bytes that are not UTF-8 ({exc.reason})")
        ) from exc
    except RowError as exc:
        raise IndexCorruptionError(damaged_message(what, url, str(exc))) from exc
    except OverflowError as exc:
        raise InvalidInputError(
            f"{what}: a number is outside the signed 64-bit range the index stores "
            f"(-2**63 .. 2**63-1): {exc}"
        ) from exc


def _create_database_hint(what: str, url: str, database: str) -> str:
    u = make_url(url)
    options = [("-h", u.host), ("-p", u.port), ("-U", u.username)]
    flags = "".join(f"{flag} {value} " for flag, value in options if value)
    return (
        f"{what}: the PostgreSQL database {database!r} of index {url} does not exist; create "
        f"it (empty) with `createdb {flags}{database}` or the SQL `CREATE DATABASE "
        f'"{database}"`, then run the command again (ckstore creates its tables itself)'
    )


def damaged_message(what: str, url: str, detail: str) -> str:
    """What went wrong with a damaged index, and how to get a working one back."""
    if url.startswith("sqlite:///") and not url.endswith(":memory:"):
        path = url[len("sqlite:///") :]
        how = (
            f"move {path} (and its -wal and -shm files, if any) aside, then rebuild the index "
            "from the store's packs and manifests with `ckstore --store <store> reindex`"
        )
    else:
        how = (
            "restore the database from a backup, or rebuild it from the store's packs and "
            "manifests into a fresh, empty database with `ckstore --store <store> --index "
            "<new url> reindex`"
        )
    return (
        f"{what}: the index database {url} is damaged ({detail}). The store's objects are "
        f"not affected: {how} (tags are not recovered; see docs/RELIABILITY.md, I5)"
    )


def _is_full(orig: BaseException | None) -> bool:
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == _SQLITE_FULL:
        return True
    text = str(orig).lower()
    return "database or disk is full" in text or "no space left on device" in text


def _is_read_only(orig: BaseException | None) -> bool:
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == _SQLITE_READONLY:
        return True
    return any(word in str(orig).lower() for word in _READ_ONLY_WORDS)


def _is_corruption(orig: BaseException | None) -> bool:
    if not isinstance(orig, sqlite3.DatabaseError):
        return False
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(orig).lower()
    return any(word in text for word in _CORRUPT_WORDS)


def _first_line(exc: BaseException) -> str:
    try:
        text = str(getattr(exc, "orig", None) or exc)
    except UnicodeDecodeError:
        return type(exc).__name__
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
