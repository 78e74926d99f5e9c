"""Translation of SQLAlchemy errors into ckstore errors at the index boundary."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from ckstore.errors import ConflictError, IndexError_, NotFoundError

_NO_DATABASE = re.compile(r'database "([^"]+)" does not exist')


@contextmanager
def translated(what: str, url: str) -> Iterator[None]:
    """Re-raises SQLAlchemy errors raised inside the block as ckstore errors.

    Args:
        what: The operation, for the message (``"commit snapshot abc"``).
        url: The index URL (password hidden), for the message.

    Raises:
        ConflictError: For integrity violations (a concurrent writer took a name or id).
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
    except OperationalError as exc:
        missing = _NO_DATABASE.search(str(exc.orig or exc))
        if missing:
            raise NotFoundError(_create_database_hint(what, url, missing.group(1))) from exc
        raise IndexError_(f"{what}: the index database {url} failed: {_first_line(exc)}") from exc
    except SQLAlchemyError as exc:
        raise IndexError_(f"{what}: index error on {url}: {_first_line(exc)}") from exc


def _create_database_hint(what: str, url: str, database: str) -> str:
    u = make_url(url)
    options = [("-h", u.host), ("-p", u.port), ("-U", u.username)]
    flags = "".join(f"{flag} {value} " for flag, value in options if value)
    return (
        f"{what}: the PostgreSQL database {database!r} of index {url} does not exist; create "
        f"it (empty) with `createdb {flags}{database}` or the SQL `CREATE DATABASE "
        f'"{database}"`, then run the command again (ckstore creates its tables itself)'
    )


def _first_line(exc: Exception) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
