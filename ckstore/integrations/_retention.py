"""A trainer's retention as the store's: the disk its removals freed given back in the job."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store import Store


def reclaim(store: Store, wait: bool) -> bool:
    """Give back what this handle's deleted snapshots used (``store.gc()``: at once when
    nothing else writes the store) once its background compaction is idle; with ``wait``, wait
    for it. Returns whether the gc ran (False: compaction was busy, try again later)."""
    if wait or store.wait_compacted(timeout=0):
        store.gc()
        return True
    return False
