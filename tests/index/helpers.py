"""Builders of index records for the tests."""

from __future__ import annotations

import hashlib
import time

from ckstore.index import ChunkRecord, EntryRecord, Index, PackRecord, SnapshotRecord


def cid(label: str) -> str:
    """A 64-hex chunk id derived from a label."""
    return hashlib.sha256(label.encode()).hexdigest()


def add_chunks(ix: Index, session_id: str, pack_id: str, labels: list[str]) -> list[str]:
    """Adds one pack holding chunks named by ``labels``; returns their ids."""
    records = [
        ChunkRecord(cid(label), pack_id, offset=100 * i, length=10 + i, raw_length=64, codec="zstd")
        for i, label in enumerate(labels)
    ]
    ix.add_pack(
        session_id, PackRecord(pack_id, size=100 * len(labels), chunk_count=len(labels)), records
    )
    return [r.chunk_id for r in records]


def snapshot(
    run: str,
    step: int | None,
    *,
    sid: str | None = None,
    name: str | None = None,
    manifest: str | None = None,
    created_at: float | None = None,
) -> SnapshotRecord:
    """A snapshot record with a deterministic id."""
    sid = sid or hashlib.sha256(f"{run}@{step}@{name}@{time.time_ns()}".encode()).hexdigest()
    return SnapshotRecord(
        id=sid,
        run=run,
        step=step,
        parent_id="ignored",
        manifest_id=manifest or f"m-{sid[:12]}",
        created_at=created_at if created_at is not None else time.time(),
        metadata={"loss": 1.5, "note": "x"},
        logical_bytes=128,
        new_bytes=64,
        new_chunks=1,
        reused_chunks=1,
        name=name,
        world_size=2,
    )


ENTRIES = [
    EntryRecord("model/w", "tensor", "float32", (4, 4), 64, "d1"),
    EntryRecord("model/b", "tensor", "bfloat16", (4,), 8, "d2"),
    EntryRecord("step", "inline", None, None, 8, "d3"),
]


def commit(
    ix: Index, run: str, step: int | None, labels: list[str] | None = None, **kwargs: object
) -> SnapshotRecord:
    """Runs a whole write session: pack, lookup, commit."""
    tags = kwargs.pop("tags", ())
    session = ix.begin_session("test", 30)
    labels = labels if labels is not None else [f"{run}-{step}-a", "shared"]
    ids = add_chunks(ix, session.id, f"pack-{run}-{step}-{time.time_ns()}", labels)
    record = snapshot(run, step, **kwargs)  # type: ignore[arg-type]
    return ix.commit_snapshot(session.id, record, ENTRIES, ids, 321, tags=tags)  # type: ignore[arg-type]
