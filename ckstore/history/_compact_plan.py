"""A compaction's plan, from the index and the manifests alone (step 1 of ``compact``).

The loose chunks outside every run's newest ``keep_loose`` snapshots, in the order of the
oldest snapshot that uses them; for each, a delta base candidate: the chunk at the same place
(key, dtype, shape, grid box) in that snapshot's parent, the run's snapshot before it, as a take
with ``delta_base="parent"`` would use. Nothing is read from the packs here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import objects
from ..format.dtypes import GROUPED, itemsize
from ..format.manifest import Manifest, TensorEntry
from ..index import ChunkRecord, SnapshotRecord

if TYPE_CHECKING:
    from ..engine.interfaces import CompactIndex
    from ..engine.repository import Repository


@dataclass
class Job:
    """One loose chunk to rewrite: its row, its element size, its delta base (if any)."""

    rec: ChunkRecord
    itemsize: int
    grouped: bool
    base_id: str = ""
    base: ChunkRecord | None = None
    base_known: dict[str, ChunkRecord] = field(default_factory=dict)


def hot(index: CompactIndex, keep_loose: int) -> set[str]:
    """Chunk ids of every run's newest ``keep_loose`` snapshots."""
    out: set[str] = set()
    if keep_loose <= 0:
        return out
    for run in index.list_runs():
        for rec in index.list_snapshots(run=run, limit=keep_loose):
            out |= index.snapshot_chunk_ids(rec.id)
    return out


def plan(repo: Repository, keep_loose: int) -> tuple[list[Job], int]:
    """The loose chunks to rewrite, oldest snapshot first, with their base candidates, and the
    number of snapshots they come from."""
    index: CompactIndex = repo.index
    loose = {c.chunk_id: c for c in index.loose_chunks() if c.codec in objects.FAST_CODECS}
    for cid in hot(index, keep_loose):
        loose.pop(cid, None)
    if not loose:
        return [], 0
    records = sorted(
        (index.get_snapshot(s) for s in index.referencing_snapshots(loose)),
        key=lambda r: (r.created_at, r.id),
    )
    jobs: list[Job] = []
    snaps = 0
    for rec in records:
        manifest = repo.load_manifest(rec)
        parent = _parent_manifest(repo, rec)
        found = False
        for key, entry in manifest.entries.items():
            for job in _jobs_of(key, entry, parent, loose):
                jobs.append(job)
                found = True
        for cid in manifest.parts:  # a manifest's parts and nodes: JSON, no delta base
            row = loose.pop(cid, None)
            if row is not None:
                jobs.append(Job(row, 1, False))
                found = True
        snaps += found
    return jobs, snaps


def _parent_manifest(repo: Repository, rec: SnapshotRecord) -> Manifest | None:
    index: CompactIndex = repo.index
    if rec.parent_id is None or repo.delta_depth == 0:
        return None
    try:
        return repo.load_manifest(index.get_snapshot(rec.parent_id))
    except Exception:  # noqa: BLE001 - a parent gone or unreadable: no deltas for this snapshot
        return None


def _jobs_of(
    key: str, entry: Any, parent: Manifest | None, loose: dict[str, ChunkRecord]
) -> Iterator[Job]:
    """Jobs for the loose chunks of one entry (each chunk once: ``loose`` loses them)."""
    if not isinstance(entry, TensorEntry) or entry.inline:
        return
    size = itemsize(entry.dtype)
    old = parent.entries.get(key) if parent is not None else None
    at: dict[tuple[Any, Any], str] = {}
    if (
        isinstance(old, TensorEntry)
        and not old.inline
        and (old.dtype, old.shape) == (entry.dtype, entry.shape)
    ):
        at = {(c.offsets, c.sizes): c.id for c in old.chunks}
    for c in entry.chunks:
        rec = loose.pop(c.id, None)
        if rec is not None:
            base = at.get((c.offsets, c.sizes), "")
            yield Job(rec, size, entry.dtype in GROUPED, base if base != c.id else "")
