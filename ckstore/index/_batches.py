"""Batching of ids into queries (no SQLAlchemy here: ``lite`` uses it too)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

BATCH_SIZE = 500
"""Most ids bound into one ``IN (...)`` query (well below SQLite's variable limit)."""

T = TypeVar("T")


def batches(items: Iterable[T], size: int = BATCH_SIZE) -> Iterator[list[T]]:
    """Yields lists of at most ``size`` items."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def unique(ids: Iterable[str]) -> list[str]:
    """Returns the ids without duplicates, in first-seen order."""
    return list(dict.fromkeys(ids))
