"""Translation of SQLAlchemy errors into ckstore errors at the index boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from ckstore.errors import ConflictError, IndexError_


@contextmanager
def translated(what: str, url: str) -> Iterator[None]:
    """Re-raises SQLAlchemy errors raised inside the block as ckstore errors.

    Args:
        what: The operation, for the message (``"commit snapshot abc"``).
        url: The index URL (password hidden), for the message.

    Raises:
        ConflictError: For integrity violations (a concurrent writer took a name or id).
        IndexError_: For every other database failure (unreachable, locked, broken).
    """
    try:
        yield
    except IntegrityError as exc:
        raise ConflictError(
            f"{what}: a concurrent change conflicts ({_first_line(exc)}); retry"
        ) from exc
    except OperationalError as exc:
        raise IndexError_(f"{what}: the index database {url} failed: {_first_line(exc)}") from exc
    except SQLAlchemyError as exc:
        raise IndexError_(f"{what}: index error on {url}: {_first_line(exc)}") from exc


def _first_line(exc: Exception) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
