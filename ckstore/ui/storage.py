"""What snapshots cost: per-run totals, one snapshot's details and what it shares.

Per snapshot the index records ``logical_bytes`` (its tensors as full copies) and
``new_bytes`` (the stored bytes its take wrote: chunks the store lacked, compressed, deltas
where smaller). The chart of the page plots both from the overview; this module adds the
per-run sums, and for one snapshot: its stored size, the chunks only it references, and what
it shares with the snapshots around it (:func:`sharing_candidates`).
"""

from __future__ import annotations

from typing import Any

from ..index import SnapshotRecord
from ..store import Store
from .timeline import History, ref_of

MAX_CANDIDATES = 48
"""Most snapshots one snapshot's sharing is measured against."""


def run_totals(history: History) -> list[dict[str, Any]]:
    """Per run: snapshots, logical bytes, bytes its takes stored, and the ratio of the two."""
    totals: dict[str, dict[str, Any]] = {}
    for r in history.records:
        row = totals.setdefault(
            r.run,
            {
                "run": r.run,
                "snapshots": 0,
                "logical_bytes": 0,
                "new_bytes": 0,
                "first": r.created_at,
            },
        )
        row["snapshots"] += 1
        row["logical_bytes"] += r.logical_bytes
        row["new_bytes"] += r.new_bytes
        row["last"] = r.created_at
    for row in totals.values():
        row["ratio"] = row["logical_bytes"] / row["new_bytes"] if row["new_bytes"] else None
    return list(totals.values())


def exact_usage(store: Store) -> dict[str, Any]:
    """``ckstore du``: unique stored bytes per run and in total (scans the references)."""
    rows = store.du()
    return {"runs": [r.to_dict() for r in rows[:-1]], "total": rows[-1].to_dict()}


def snapshot_detail(store: Store, history: History, ref: str) -> dict[str, Any]:
    """One snapshot: its record, tags, stored size, exclusive chunks and sharing.

    Raises:
        SnapshotNotFoundError: ``ref`` names nothing.
        InvalidInputError: ``ref`` is malformed or an ambiguous id prefix.
    """
    snap = store.get(ref)
    record = snap.record
    tags = sorted(name for name, sid in history.tags.items() if sid == record.id)
    exclusive_chunks, exclusive_bytes = snap.exclusive_usage()
    by_id = {r.id: r for r in history.records}
    candidates = sharing_candidates(history, record)
    shared = snap.shared_with([c for c, _ in candidates])
    why = dict(candidates)
    return {
        "id": record.id,
        "ref": ref_of(record),
        "run": record.run,
        "step": record.step,
        "name": record.name,
        "parent_id": record.parent_id,
        "created_at": record.created_at,
        "world_size": record.world_size,
        "manifest_id": record.manifest_id,
        "metadata": record.metadata,
        "tags": tags,
        "logical_bytes": record.logical_bytes,
        "new_bytes": record.new_bytes,
        "new_chunks": record.new_chunks,
        "reused_chunks": record.reused_chunks,
        "nonfinite": record.nonfinite,
        "stale": record.stale,
        "forked_from": _fork(snap.forked_from, by_id),
        "stored_bytes": snap.stored_bytes(),
        "exclusive_chunks": exclusive_chunks,
        "exclusive_bytes": exclusive_bytes,
        "shared": [
            {
                "id": s.snapshot_id,
                "ref": ref_of(by_id[s.snapshot_id])
                if s.snapshot_id in by_id
                else s.snapshot_id[:12],
                "relation": why.get(s.snapshot_id, "other"),
                "chunks": s.chunks,
                "stored_bytes": s.stored_bytes,
            }
            for s in shared
        ],
    }


def _fork(source: str | None, by_id: dict[str, SnapshotRecord]) -> dict[str, str] | None:
    """The snapshot a take recorded as its source: id and ref (its id alone once deleted)."""
    if source is None:
        return None
    return {"id": source, "ref": ref_of(by_id[source]) if source in by_id else source[:12]}


def sharing_candidates(history: History, record: SnapshotRecord) -> list[tuple[str, str]]:
    """The snapshots whose sharing with ``record`` is worth measuring, with their relation.

    Its parent and children, two neighbours each way in its run, the tagged snapshots and the
    latest snapshot of every other run (at most ``MAX_CANDIDATES``, in that order).
    """
    out: dict[str, str] = {}
    same_run = [r for r in history.records if r.run == record.run]
    where = next((i for i, r in enumerate(same_run) if r.id == record.id), 0)
    if record.parent_id:
        out[record.parent_id] = "parent"
    for r in history.records:
        if r.parent_id == record.id:
            out.setdefault(r.id, "child")
    for r in same_run[max(0, where - 2) : where + 3]:
        out.setdefault(r.id, "same run")
    for name, sid in sorted(history.tags.items()):
        out.setdefault(sid, f"tag {name}")
    latest: dict[str, SnapshotRecord] = {}
    for r in history.records:
        latest[r.run] = r
    for run, r in latest.items():
        if run != record.run:
            out.setdefault(r.id, f"latest of {run}")
    out.pop(record.id, None)
    return list(out.items())[:MAX_CANDIDATES]
