"""Compare two snapshots key by key, cheaply first and numerically on demand.

Which keys were added, removed, changed or left unchanged is decided from the index alone: each
manifest entry has a content digest there (see ``manifest.entry_digest``), so no tensor bytes are
read. For a changed tensor of unchanged dtype and shape the two manifests' chunk lists say how
much of it changed (chunk ids are content hashes on a grid in global coordinates). With
``numeric=True`` only the changed chunks of both sides are read (each one re-hashed against its
id) to report how far apart the values are, computed in float64.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from . import objects
from ._dtypes import dtype_from_name, itemsize
from ._tensors import from_bytes
from .errors import CorruptionError
from .index import EntryRecord
from .manifest import TensorEntry, entry_digest

if TYPE_CHECKING:
    from .snapshot import Snapshot
    from .store import Store

ADDED, REMOVED, CHANGED, UNCHANGED = "added", "removed", "changed", "unchanged"
STATUSES = (ADDED, REMOVED, CHANGED, UNCHANGED)
_PIECE_BYTES = 64 << 20  # most bytes held per side at once by the numeric comparison


@dataclass(frozen=True)
class NumericDiff:
    """How far apart a changed tensor's values are, over the elements of its changed chunks.

    Attributes:
        max_abs_diff: Largest ``|b - a|`` (modulus for complex dtypes).
        l2_diff: L2 norm of ``b - a``.
        l2_a: L2 norm of side A over the same elements (not the whole tensor).
        l2_b: L2 norm of side B over the same elements.
        elements: Number of elements compared (those of the changed chunks).
    """

    max_abs_diff: float
    l2_diff: float
    l2_a: float
    l2_b: float
    elements: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs_diff": _json_float(self.max_abs_diff),
            "l2_diff": _json_float(self.l2_diff),
            "l2_a": _json_float(self.l2_a),
            "l2_b": _json_float(self.l2_b),
            "elements": self.elements,
        }


@dataclass(frozen=True)
class KeyDiff:
    """One key of the comparison.

    Attributes:
        key: The flattened app_state key.
        status: ``added``, ``removed``, ``changed`` or ``unchanged``.
        kind: Entry kind on side B (side A for removed keys).
        dtype_a, dtype_b, shape_a, shape_b: None where the side lacks the key or it is a value.
        bytes_a, bytes_b: Logical bytes on each side (None where the side lacks the key).
        changed_chunks, total_chunks: For a changed chunked tensor of equal dtype and shape, how
            many of side B's chunks differ from side A's, out of how many.
        chunk_fraction: ``changed_chunks / total_chunks``; 1.0 when dtype, shape or kind changed
            or the tensor is stored inline; None for values.
        changed_bytes: Logical bytes of side B covered by changed chunks (a changed key only).
        reason: Why the fraction is what it is, when not a plain chunk count.
        numeric: The numeric summary, when asked for and computable.
    """

    key: str
    status: str
    kind: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    bytes_a: int | None = None
    bytes_b: int | None = None
    changed_chunks: int | None = None
    total_chunks: int | None = None
    chunk_fraction: float | None = None
    changed_bytes: int | None = None
    reason: str | None = None
    numeric: NumericDiff | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key,
            "status": self.status,
            "kind": self.kind,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": None if self.shape_a is None else list(self.shape_a),
            "shape_b": None if self.shape_b is None else list(self.shape_b),
            "bytes_a": self.bytes_a,
            "bytes_b": self.bytes_b,
        }
        if self.status == CHANGED:
            d.update(
                changed_chunks=self.changed_chunks,
                total_chunks=self.total_chunks,
                chunk_fraction=self.chunk_fraction,
                changed_bytes=self.changed_bytes,
                reason=self.reason,
                numeric=None if self.numeric is None else self.numeric.to_dict(),
            )
        return d


@dataclass(frozen=True)
class SnapshotSide:
    """Which snapshot one side of the diff is."""

    ref: str
    id: str
    run: str
    step: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "id": self.id, "run": self.run, "step": self.step}


@dataclass(frozen=True)
class DiffResult:
    """The comparison of snapshot A (older, usually) with snapshot B, key by key."""

    a: SnapshotSide
    b: SnapshotSide
    keys: tuple[KeyDiff, ...]
    numeric: bool = False
    _by_status: dict[str, tuple[KeyDiff, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = {s: tuple(k for k in self.keys if k.status == s) for s in STATUSES}
        object.__setattr__(self, "_by_status", groups)

    @property
    def added(self) -> tuple[KeyDiff, ...]:
        return self._by_status[ADDED]

    @property
    def removed(self) -> tuple[KeyDiff, ...]:
        return self._by_status[REMOVED]

    @property
    def changed(self) -> tuple[KeyDiff, ...]:
        return self._by_status[CHANGED]

    @property
    def unchanged(self) -> tuple[KeyDiff, ...]:
        return self._by_status[UNCHANGED]

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def __getitem__(self, key: str) -> KeyDiff:
        for k in self.keys:
            if k.key == key:
                return k
        raise KeyError(key)

    @property
    def counts(self) -> dict[str, int]:
        return {s: len(self._by_status[s]) for s in STATUSES}

    @property
    def bytes(self) -> dict[str, int]:
        """Logical bytes per status (side B's size; side A's for removed keys)."""
        out = {
            ADDED: sum(k.bytes_b or 0 for k in self.added),
            REMOVED: sum(k.bytes_a or 0 for k in self.removed),
            CHANGED: sum(k.bytes_b or 0 for k in self.changed),
            UNCHANGED: sum(k.bytes_b or 0 for k in self.unchanged),
        }
        out["changed_chunk_bytes"] = sum(k.changed_bytes or 0 for k in self.changed)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``json.dumps`` works on it)."""
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "numeric": self.numeric,
            "counts": self.counts,
            "bytes": self.bytes,
            "keys": [k.to_dict() for k in self.keys],
        }


def diff(store: Store, a: str, b: str, numeric: bool = False) -> DiffResult:
    """Compare the snapshots that refs ``a`` and ``b`` name (see the module docstring).

    Args:
        store: The store holding both.
        a, b: Refs (tag, run, ``run@step``, snapshot name, id prefix).
        numeric: Also read the changed chunks of changed tensors and summarise the values.

    Raises:
        SnapshotNotFoundError: A ref names nothing.
        CorruptionError: A manifest or (with ``numeric``) a chunk read is damaged.
    """
    snap_a, snap_b = store.get(a), store.get(b)
    recs_a, recs_b = _entry_records(snap_a), _entry_records(snap_b)
    keys: list[KeyDiff] = []
    for key, rb in recs_b.items():
        ra = recs_a.get(key)
        if ra is None:
            keys.append(_one_sided(rb, ADDED))
        elif ra.digest == rb.digest:
            keys.append(_unchanged(ra, rb))
        else:
            keys.append(_changed(snap_a, snap_b, ra, rb, numeric))
    keys.extend(_one_sided(ra, REMOVED) for key, ra in recs_a.items() if key not in recs_b)
    return DiffResult(_side(a, snap_a), _side(b, snap_b), tuple(keys), numeric)


# --- classification --------------------------------------------------------------------------
def _entry_records(snap: Snapshot) -> dict[str, EntryRecord]:
    records = snap.store.index.entries(snap.record.manifest_id)
    if not records and snap.manifest.entries:  # an index without entry rows: use the manifest
        records = [
            EntryRecord(k, e.kind, e.dtype, e.shape, e.nbytes, entry_digest(e))
            for k, e in snap.manifest.entries.items()
        ]
    return {r.key: r for r in records}


def _side(ref: str, snap: Snapshot) -> SnapshotSide:
    return SnapshotSide(ref, snap.id, snap.run, snap.step)


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
    snap_a: Snapshot, snap_b: Snapshot, ra: EntryRecord, rb: EntryRecord, numeric: bool
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
        fields["numeric"] = _numeric(snap_a, snap_b, rb.key, ea, eb)
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


# --- numeric summary ---------------------------------------------------------------------------
def _numeric(
    snap_a: Snapshot, snap_b: Snapshot, key: str, ea: TensorEntry, eb: TensorEntry
) -> NumericDiff | None:
    """Summarise the changed region of one tensor; None for dtypes without float64 values."""
    if not _numeric_dtype(eb.dtype):
        return None
    acc = _Accumulator(eb.dtype)
    if ea.inline or eb.inline:
        acc.add(_whole_bytes(snap_a, key, ea), _whole_bytes(snap_b, key, eb))
        return acc.result()
    side_a = _ChunkSide(snap_a, key, ea)
    side_b = _ChunkSide(snap_b, key, eb)
    for start, stop in _changed_ranges(ea, eb):
        acc.add(side_a.read(start, stop), side_b.read(start, stop))
    return acc.result()


def _numeric_dtype(dtype: str) -> bool:
    if dtype.startswith(("bits", "float4")):  # raw bit containers have no numeric value
        return False
    try:
        torch.zeros(1, dtype=dtype_from_name(dtype)).to(torch.float64)
    except (RuntimeError, TypeError):
        return False
    return True


def _whole_bytes(snap: Snapshot, key: str, entry: TensorEntry) -> bytes:
    if entry.inline:
        return entry.data or b""
    return _ChunkSide(snap, key, entry).read(0, entry.nbytes)


def _ranges(entry: TensorEntry) -> list[tuple[int, int, str]]:
    """(start, stop, chunk id) of every chunk, in byte order of the C-order tensor."""
    size = itemsize(entry.dtype)
    strides = [1] * len(entry.shape)
    for d in range(len(entry.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * entry.shape[d + 1]
    out = []
    for c in entry.chunks:
        start = sum(o * s for o, s in zip(c.offsets, strides)) * size
        out.append((start, start + math.prod(c.sizes) * size, c.id))
    return sorted(out)


def _changed_ranges(ea: TensorEntry, eb: TensorEntry) -> Iterator[tuple[int, int]]:
    """Disjoint byte ranges covering every chunk not present identically on both sides."""
    ra, rb = _ranges(ea), _ranges(eb)
    sa, sb = set(ra), set(rb)
    spans = sorted(
        (s, e) for s, e, _ in [*(r for r in ra if r not in sb), *(r for r in rb if r not in sa)]
    )
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    step = max(_PIECE_BYTES - _PIECE_BYTES % itemsize(eb.dtype), itemsize(eb.dtype))
    for s, e in merged:
        for p in range(s, e, step):
            yield p, min(e, p + step)


class _ChunkSide:
    """Reads byte ranges of one chunked tensor, chunk by verified chunk, keeping a small cache."""

    def __init__(self, snap: Snapshot, key: str, entry: TensorEntry) -> None:
        self.objs: objects.ObjectStore = snap.store.objects
        self.where = f"snapshot {snap.ref}, key {key!r}"
        self.ranges = _ranges(entry)
        self.ends = [e for _, e, _ in self.ranges]
        self.last_end = {cid: e for _, e, cid in self.ranges}  # ranges are sorted
        self.locs = snap.store.index.chunk_locations(self.last_end)
        self.cache: dict[str, bytes] = {}

    def read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the tensor; calls must come in increasing byte order."""
        out = bytearray(stop - start)
        i = bisect.bisect_right(self.ends, start)
        while i < len(self.ranges) and self.ranges[i][0] < stop:
            s, e, cid = self.ranges[i]
            data = self._chunk(cid)
            lo, hi = max(s, start), min(e, stop)
            out[lo - start : hi - start] = data[lo - s : hi - s]
            i += 1
        self.cache = {k: v for k, v in self.cache.items() if self.last_end[k] > stop}
        return bytes(out)

    def _chunk(self, cid: str) -> bytes:
        if cid not in self.cache:
            rec = self.locs.get(cid)
            if rec is None:
                hint = "run `ckstore check`"
                raise CorruptionError(
                    f"{self.where}: chunk {cid[:16]}… is unknown to the index; {hint}"
                )
            loc = objects.ChunkLocation(
                rec.chunk_id, rec.pack_id, rec.offset, rec.length, rec.raw_length, rec.codec
            )
            self.cache[cid] = bytes(self.objs.read_chunk(loc))
        return self.cache[cid]


class _Accumulator:
    """Running max |b - a| and sums of squares, in float64 (complex128 for complex dtypes)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.wide = torch.complex128 if dtype.startswith("complex") else torch.float64
        self.max_abs = 0.0
        self.sq_diff = self.sq_a = self.sq_b = 0.0
        self.elements = 0

    def add(self, raw_a: bytes, raw_b: bytes) -> None:
        n = len(raw_b) // itemsize(self.dtype)
        if n == 0:
            return
        a = from_bytes(raw_a, self.dtype, (n,)).to(self.wide)
        b = from_bytes(raw_b, self.dtype, (n,)).to(self.wide)
        d = (b - a).abs()
        m = float(d.max())
        if math.isnan(m) or m > self.max_abs:  # NaN, once seen, stays
            self.max_abs = m
        self.sq_diff += float((d * d).sum())
        self.sq_a += float((a.abs() ** 2).sum())
        self.sq_b += float((b.abs() ** 2).sum())
        self.elements += n

    def result(self) -> NumericDiff:
        return NumericDiff(
            self.max_abs,
            math.sqrt(self.sq_diff),
            math.sqrt(self.sq_a),
            math.sqrt(self.sq_b),
            self.elements,
        )


def _json_float(x: float) -> float | str:
    """Finite floats as they are; NaN and infinities as strings (strict JSON has neither)."""
    return x if math.isfinite(x) else str(x)
