"""Disk usage: logical versus stored bytes per run, and for the whole store.

Logical bytes are what the snapshots would take as full copies (the sum of their tensors' sizes).
Stored bytes count each chunk once, at its stored (compressed) length: per run, the unique chunks
its snapshots reference; store-wide, the unique chunks of every snapshot. The ratio logical /
stored is the saving from dedup and compression together. Pack bytes on the backend also hold
chunks no snapshot references any more (reclaimed by ``gc``) and pack headers.

A run's *exclusive* bytes are the stored bytes of the chunks only that run references (shared
ones are counted by no run): what deleting the run (``ckstore rm --run``) and a ``gc`` free.
A chunk that a delta of another run is stored against stays, so it is not exclusive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.interfaces import UsageIndex
    from ..engine.repository import Repository
    from ..index.usage import Usage


@dataclass(frozen=True)
class UsageRow:
    """Usage of one run (``run`` is None on the store-wide total row).

    Attributes:
        run: Run name, or None for the total.
        snapshots: Number of snapshots.
        logical_bytes: Sum of the snapshots' logical sizes.
        stored_bytes: Stored length of the unique chunks they reference.
        chunks: Number of those unique chunks.
        pack_bytes: Total row only: bytes of every pack object on the backend.
        packs: Total row only: number of pack objects on the backend.
        delta_chunks: Of the unique chunks, how many are stored as deltas...
        delta_raw_bytes: ...their raw size...
        delta_bytes: ...and their stored length (included in ``stored_bytes``). The bases they
            need are counted where they are referenced (a base model's run, an older snapshot).
        exclusive_bytes: Per run: stored bytes of the chunks no other run needs (what
            deleting the run frees); None on the total row.
        remote_bytes: Total row only: of ``stored_bytes``, those at a remote only (a two-tier
            store evicted them from this disk; reads fetch them, verified).
    """

    run: str | None
    snapshots: int
    logical_bytes: int
    stored_bytes: int
    chunks: int
    pack_bytes: int | None = None
    packs: int | None = None
    delta_chunks: int = 0
    delta_raw_bytes: int = 0
    delta_bytes: int = 0
    exclusive_bytes: int | None = None
    remote_bytes: int = 0

    @property
    def unreferenced_bytes(self) -> int | None:
        """Total row only: pack bytes on this disk beyond the referenced chunks kept here: pack
        headers and trailers, and chunks no snapshot references (a cancelled or running
        take's, what gc reclaims after its grace period). None on a run's row."""
        if self.pack_bytes is None:
            return None
        return max(0, self.pack_bytes - (self.stored_bytes - self.remote_bytes))

    @property
    def delta_saved_bytes(self) -> int:
        """Raw bytes of the delta chunks that their deltas did not store."""
        return self.delta_raw_bytes - self.delta_bytes

    @property
    def dedup_ratio(self) -> float | None:
        """logical / stored; None when nothing is stored."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "run": self.run,
            "snapshots": self.snapshots,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "chunks": self.chunks,
            "dedup_ratio": self.dedup_ratio,
            "delta_chunks": self.delta_chunks,
            "delta_raw_bytes": self.delta_raw_bytes,
            "delta_bytes": self.delta_bytes,
        }
        if self.run is not None:
            d["exclusive_bytes"] = self.exclusive_bytes
        else:
            d.update(
                pack_bytes=self.pack_bytes,
                packs=self.packs,
                remote_bytes=self.remote_bytes,
                unreferenced_bytes=self.unreferenced_bytes,
            )
        return d


def du(
    repo: Repository, progress: Callable[[Iterable[str]], Iterable[str]] | None = None
) -> list[UsageRow]:
    """Per-run usage rows in run order, then one store-wide total row (``run=None``).

    Args:
        repo: The store's repository.
        progress: Optional wrapper around the pack iteration (e.g. a progress bar).
    """
    index: UsageIndex = repo.index
    found = index.usage()
    rows = [_row(u, exclusive_bytes=found.exclusive.get(u.run or "", 0)) for u in found.runs]
    pack_ids = repo.objects.list_packs()
    sizes = (repo.objects.pack_size(p) for p in (progress(pack_ids) if progress else pack_ids))
    return [*rows, _row(found.total, pack_bytes=sum(sizes), packs=len(pack_ids))]


def _row(u: Usage, **extra: Any) -> UsageRow:
    return UsageRow(
        u.run,
        u.snapshots,
        u.logical_bytes,
        u.stored_bytes,
        u.chunks,
        delta_chunks=u.delta_chunks,
        delta_raw_bytes=u.delta_raw_bytes,
        delta_bytes=u.delta_bytes,
        remote_bytes=u.remote_bytes,
        **extra,
    )


def exclusive_bytes(repo: Repository) -> dict[str, int]:
    """Run -> stored bytes of the chunks only that run needs (see the module docstring)."""
    index: UsageIndex = repo.index
    return index.exclusive_by_run()
