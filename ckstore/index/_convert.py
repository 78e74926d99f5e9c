"""Conversions between table rows and the frozen records of ``records.py``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ckstore.index.records import (
    ChunkRecord,
    EntryRecord,
    SessionRecord,
    SnapshotRecord,
    TagRecord,
)

if TYPE_CHECKING:
    from sqlalchemy import Row


class RowError(ValueError):
    """A row read from the index does not decode (e.g. a metadata column that is not JSON)."""


def chunk(row: Row[Any]) -> ChunkRecord:
    """Builds a ChunkRecord from a ``chunks`` row.

    Raises:
        RowError: a column has the wrong type or a negative size (a damaged index).
    """
    numbers = (row.offset, row.length, row.raw_length, row.depth)
    if (
        not all(type(v) is int and v >= 0 for v in numbers)
        or not all(isinstance(v, str) for v in (row.id, row.pack_id, row.codec))
        or not all(v is None or isinstance(v, str) for v in (row.base_id, row.payload_digest))
    ):
        raise RowError(f"chunk row {str(row.id)[:64]!r} holds {tuple(row)!r:.200}")
    return ChunkRecord(
        chunk_id=row.id,
        pack_id=row.pack_id,
        offset=row.offset,
        length=row.length,
        raw_length=row.raw_length,
        codec=row.codec,
        base_id=row.base_id,
        depth=row.depth,
        payload_digest=row.payload_digest,
    )


def _json(text: Any, what: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise RowError(f"{what} is not JSON: {str(text)[:80]!r}") from exc


def chunk_row(record: ChunkRecord, created_at: float) -> dict[str, Any]:
    """Returns the ``chunks`` row of a ChunkRecord."""
    return {
        "id": record.chunk_id,
        "pack_id": record.pack_id,
        "offset": record.offset,
        "length": record.length,
        "raw_length": record.raw_length,
        "codec": record.codec,
        "created_at": created_at,
        "base_id": record.base_id,
        "depth": record.depth,
        "payload_digest": record.payload_digest,
    }


def entry(row: Row[Any]) -> EntryRecord:
    """Builds an EntryRecord from a ``manifest_entries`` row."""
    try:
        shape = None if row.shape is None else tuple(int(d) for d in _json(row.shape, "shape"))
    except (TypeError, ValueError) as exc:
        raise RowError(f"manifest entry {row.key!r}: shape {row.shape!r:.80}") from exc
    return EntryRecord(
        key=row.key,
        kind=row.kind,
        dtype=row.dtype,
        shape=shape,
        nbytes=row.nbytes,
        digest=row.digest,
    )


def entry_row(manifest_id: str, position: int, record: EntryRecord) -> dict[str, Any]:
    """Returns the ``manifest_entries`` row of an EntryRecord."""
    shape = None if record.shape is None else json.dumps([int(d) for d in record.shape])
    return {
        "manifest_id": manifest_id,
        "key": record.key,
        "position": position,
        "kind": record.kind,
        "dtype": record.dtype,
        "shape": shape,
        "nbytes": int(record.nbytes),
        "digest": record.digest,
    }


def snapshot(row: Row[Any]) -> SnapshotRecord:
    """Builds a SnapshotRecord from a ``snapshots`` row."""
    return SnapshotRecord(
        id=row.id,
        run=row.run,
        step=row.step,
        parent_id=row.parent_id,
        manifest_id=row.manifest_id,
        created_at=row.created_at,
        metadata=_metadata(row),
        logical_bytes=row.logical_bytes,
        new_bytes=row.new_bytes,
        new_chunks=row.new_chunks,
        reused_chunks=row.reused_chunks,
        name=row.name,
        world_size=row.world_size,
        nonfinite=_count(row.nonfinite, "nonfinite", row.id),
        stale=_count(row.stale, "stale", row.id),
        diverged=_count(row.diverged, "diverged", row.id),
    )


def _count(value: Any, what: str, snapshot_id: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise RowError(f"the {what} count of snapshot {str(snapshot_id)[:64]!r} is {value!r:.80}")
    return value


def _metadata(row: Row[Any]) -> dict[str, Any]:
    value = _json(row.metadata, f"the metadata of snapshot {row.id}")
    if not isinstance(value, dict):
        raise RowError(f"the metadata of snapshot {row.id} is not a JSON object")
    return value


def snapshot_row(record: SnapshotRecord, seq: int) -> dict[str, Any]:
    """Returns the ``snapshots`` row of a SnapshotRecord (column names, not attributes)."""
    return {
        "id": record.id,
        "run": record.run,
        "seq": seq,
        "step": record.step,
        "parent_id": record.parent_id,
        "manifest_id": record.manifest_id,
        "created_at": record.created_at,
        "metadata": json.dumps(record.metadata, sort_keys=True, separators=(",", ":")),
        "logical_bytes": record.logical_bytes,
        "new_bytes": record.new_bytes,
        "new_chunks": record.new_chunks,
        "reused_chunks": record.reused_chunks,
        "name": record.name,
        "world_size": record.world_size,
        "nonfinite": record.nonfinite,
        "stale": record.stale,
        "diverged": record.diverged,
    }


def tag(row: Row[Any]) -> TagRecord:
    """Builds a TagRecord from a ``tags`` row."""
    return TagRecord(
        name=row.name,
        snapshot_id=row.snapshot_id,
        version=row.version,
        updated_at=row.updated_at,
    )


def session(row: Row[Any]) -> SessionRecord:
    """Builds a SessionRecord from a ``sessions`` row."""
    return SessionRecord(
        id=row.id,
        owner=row.owner,
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        expires_at=row.expires_at,
        state=row.state,
    )
