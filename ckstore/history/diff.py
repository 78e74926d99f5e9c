"""Compare two snapshots key by key, cheaply first and numerically on demand.

Which keys were added, removed, changed or left unchanged is decided from the index alone: each
manifest entry has a content digest there (see ``manifest.entry_digest``), so no tensor bytes are
read. For a changed tensor of unchanged dtype and shape the two manifests' chunk lists say how
much of it changed (chunk ids are content hashes on a grid in global coordinates). With
``numeric=True`` only the changed chunks of both sides are read (each one re-hashed against its
id) to report how far apart the values are, computed in float64. Chunks are compared as boxes of
the global tensor, so pieces of grid blocks cut by shard boxes (distributed takes), and two
sides cut into different boxes (takes with different world sizes), compare correctly.

The result types live in ``_diff_result``, the numeric summary in ``_diff_numeric``; this module
classifies the keys and says how many chunks of each changed tensor changed. Each side also
carries what its take recorded of the state's health (NaN/Inf counts and norms per tensor,
stale tensors: the manifest header), so a diff shows where a run went bad.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..engine.take.commit import entry_records
from ..engine.view import SnapshotView
from ..errors import CorruptionError
from ..format.dtypes import itemsize
from ..format.health import Health, of_header
from ..format.manifest import TensorEntry, entry_digest
from ..format.parts import DIGEST_PREFIX
from ..index import EntryRecord
from .diff_result import (
    ADDED,
    CHANGED,
    REMOVED,
    STATUSES,
    UNCHANGED,
    DeltaSavings,
    DiffResult,
    KeyDiff,
    NumericDiff,
    SnapshotSide,
)

if TYPE_CHECKING:
    from ..engine.interfaces import ReadIndex
    from ..engine.repository import Repository

__all__ = [
    "ADDED",
    "CHANGED",
    "REMOVED",
    "STATUSES",
    "UNCHANGED",
    "DiffResult",
    "KeyDiff",
    "NumericDiff",
    "SnapshotSide",
    "diff",
]


def diff(repo: Repository, a: str, b: str, numeric: bool = False) -> DiffResult:
    """Compare the snapshots that refs ``a`` and ``b`` name (see the module docstring).

    Args:
        store: The store holding both.
        a, b: Refs (tag, run, ``run@step``, snapshot name, id prefix).
        numeric: Also read the changed chunks of changed tensors and summarise the values.

    Raises:
        SnapshotNotFoundError: A ref names nothing.
        CorruptionError: A manifest or (with ``numeric``) a chunk read is damaged.
    """
    index: ReadIndex = repo.index
    snap_a = SnapshotView(repo, index.resolve(a))
    snap_b = SnapshotView(repo, index.resolve(b))
    recs_a, recs_b = _entry_records(snap_a), _entry_records(snap_b)
    keys: list[KeyDiff] = []
    for key, rb in recs_b.items():
        ra = recs_a.get(key)
        if ra is None:
            keys.append(_one_sided(rb, ADDED))
        elif _equal(snap_a, snap_b, ra, rb):
            keys.append(_unchanged(ra, rb))
        else:
            keys.append(_changed(snap_a, snap_b, ra, rb, numeric))
    keys.extend(_one_sided(ra, REMOVED) for key, ra in recs_a.items() if key not in recs_b)
    health_a, health_b = _health(snap_a), _health(snap_b)
    keys = [_with_health(k, health_a, health_b) for k in keys]
    return DiffResult(
        _side(a, snap_a, health_a),
        _side(b, snap_b, health_b),
        tuple(keys),
        numeric,
        _savings(snap_a, snap_b),
    )


def _health(snap: SnapshotView) -> Health | None:
    """The health the snapshot's take recorded (its manifest header), or None."""
    return of_header(snap.header)


def _equal(snap_a: SnapshotView, snap_b: SnapshotView, ra: EntryRecord, rb: EntryRecord) -> bool:
    """Whether an entry is unchanged: equal digests; between an entry a take stored in parts
    and one it stored whole (digests of two kinds), equal entries in the manifests."""
    if ra.digest == rb.digest:
        return True
    if ra.digest.startswith(DIGEST_PREFIX) == rb.digest.startswith(DIGEST_PREFIX):
        return False
    ea, eb = snap_a.manifest.entries.get(ra.key), snap_b.manifest.entries.get(rb.key)
    return ea is not None and eb is not None and entry_digest(ea) == entry_digest(eb)


def _with_health(k: KeyDiff, a: Health | None, b: Health | None) -> KeyDiff:
    """``k`` with each side's figures for its tensor, where recorded (unchanged keys too: a
    NaN that was already there is worth seeing)."""
    ha = (
        a.tensors.get(k.key)
        if a is not None and a.tensors is not None and k.status != ADDED
        else None
    )
    hb = (
        b.tensors.get(k.key)
        if b is not None and b.tensors is not None and k.status != REMOVED
        else None
    )
    if ha is None and hb is None:
        return k
    return replace(
        k,
        health_a=None if ha is None else ha.to_dict(),
        health_b=None if hb is None else hb.to_dict(),
    )


def _savings(snap_a: SnapshotView, snap_b: SnapshotView) -> DeltaSavings:
    """What B stores beyond A, and how much of it as deltas (from the index alone)."""
    index: ReadIndex = snap_b.repo.index
    new = index.snapshot_chunk_ids(snap_b.id) - index.snapshot_chunk_ids(snap_a.id)
    recs = [r for cid, r in index.chunk_locations(new).items() if cid in new]
    deltas = [r for r in recs if r.base_id is not None]
    return DeltaSavings(
        len(recs),
        sum(r.raw_length for r in recs),
        sum(r.length for r in recs),
        len(deltas),
        sum(r.raw_length for r in deltas),
        sum(r.length for r in deltas),
    )


# --- classification --------------------------------------------------------------------------
def _entry_records(snap: SnapshotView) -> dict[str, EntryRecord]:
    index: ReadIndex = snap.repo.index
    records = index.entries(snap.record.manifest_id)
    if not records and snap.manifest.entries:  # an index without entry rows: use the manifest
        records = entry_records(snap.manifest)
    return {r.key: r for r in records}


def _side(ref: str, snap: SnapshotView, health: Health | None) -> SnapshotSide:
    summary = None if health is None else {"nonfinite": health.nonfinite, "stale": health.stale}
    return SnapshotSide(ref, snap.id, snap.run, snap.step, summary)


def _shape(r: EntryRecord) -> tuple[int, ...] | None:
    return None if r.shape is None else tuple(r.shape)


def _one_sided(r: EntryRecord, status: str) -> KeyDiff:
    if status == ADDED:
        return KeyDiff(r.key, status, r.kind, dtype_b=r.dtype, shape_b=_shape(r), bytes_b=r.nbytes)
    return KeyDiff(r.key, status, r.kind, dtype_a=r.dtype, shape_a=_shape(r), bytes_a=r.nbytes)


def _unchanged(ra: EntryRecord, rb: EntryRecord) -> KeyDiff:
    return KeyDiff(
        rb.key, UNCHANGED, rb.kind, ra.dtype, rb.dtype, _shape(ra), _shape(rb), ra.nbytes, rb.nbytes
    )


def _changed(
    snap_a: SnapshotView, snap_b: SnapshotView, ra: EntryRecord, rb: EntryRecord, numeric: bool
) -> KeyDiff:
    base = KeyDiff(
        rb.key, CHANGED, rb.kind, ra.dtype, rb.dtype, _shape(ra), _shape(rb), ra.nbytes, rb.nbytes
    )
    reason = _whole_change_reason(ra, rb)
    if reason is not None:
        fraction = None if ra.kind == rb.kind == "value" else 1.0
        return _replace(base, chunk_fraction=fraction, changed_bytes=rb.nbytes, reason=reason)
    ea, eb = snap_a.manifest.entries.get(ra.key), snap_b.manifest.entries.get(rb.key)
    if not isinstance(ea, TensorEntry) or not isinstance(eb, TensorEntry):
        raise CorruptionError(f"key {rb.key!r}: the index says tensor but the manifest disagrees")
    fields = _chunk_change(ea, eb)
    if numeric:
        from .diff_numeric import numeric_diff  # imports torch: a plain diff does not

        fields["numeric"] = numeric_diff(snap_a, snap_b, rb.key, ea, eb)
    return _replace(base, **fields)


def _whole_change_reason(ra: EntryRecord, rb: EntryRecord) -> str | None:
    """Why the whole entry counts as changed, or None when chunks can be compared."""
    if ra.kind != rb.kind:
        return f"kind changed: {ra.kind} -> {rb.kind}"
    if ra.kind != "tensor":
        return "value changed"
    if ra.dtype != rb.dtype:
        return f"dtype changed: {ra.dtype} -> {rb.dtype}"
    if _shape(ra) != _shape(rb):
        return f"shape changed: {list(ra.shape or ())} -> {list(rb.shape or ())}"
    return None


def _chunk_change(ea: TensorEntry, eb: TensorEntry) -> dict[str, Any]:
    if ea.inline or eb.inline:
        return {
            "chunk_fraction": 1.0,
            "changed_bytes": eb.nbytes,
            "reason": "stored inline (no chunks)",
        }
    old = {(c.offsets, c.sizes): c.id for c in ea.chunks}
    changed = [c for c in eb.chunks if old.get((c.offsets, c.sizes)) != c.id]
    size = itemsize(eb.dtype)
    out: dict[str, Any] = {
        "changed_chunks": len(changed),
        "total_chunks": len(eb.chunks),
        "chunk_fraction": len(changed) / len(eb.chunks) if eb.chunks else 0.0,
        "changed_bytes": sum(math.prod(c.sizes) for c in changed) * size,
    }
    if {c.offsets for c in ea.chunks} != {c.offsets for c in eb.chunks}:
        out["reason"] = "chunk grids differ (sharding or chunk size changed)"
    elif not changed:
        out["reason"] = "same bytes; entry metadata differs (e.g. torch vs numpy container)"
    return out


def _replace(k: KeyDiff, **changes: Any) -> KeyDiff:
    return replace(k, **changes)
