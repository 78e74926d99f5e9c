"""Compare two snapshots key by key, cheaply first and numerically on demand.

Which keys were added, removed, changed or left unchanged is decided from the index alone: each
manifest entry has a content digest there (see ``manifest.entry_digest``), so no tensor bytes are
read. For a changed tensor of unchanged dtype and shape the two manifests' chunk lists say how
much of it changed (chunk ids are content hashes on a grid in global coordinates). With
``numeric=True`` only the changed chunks of both sides are read (each one re-hashed against its
id) to report how far apart the values are, computed in float64. Chunks are compared as boxes of
the global tensor, so pieces of grid blocks cut by shard boxes (distributed takes), and two
sides cut into different boxes (takes with different world sizes), compare correctly.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from . import objects
from ._dtypes import dtype_from_name, itemsize
from ._tensors import empty_for, from_bytes, writable_view
from .errors import CorruptionError
from .index import EntryRecord
from .manifest import ChunkRef, TensorEntry, entry_digest

if TYPE_CHECKING:
    from .snapshot import Snapshot
    from .store import Store

ADDED, REMOVED, CHANGED, UNCHANGED = "added", "removed", "changed", "unchanged"
STATUSES = (ADDED, REMOVED, CHANGED, UNCHANGED)


@dataclass(frozen=True)
class NumericDiff:
    """How far apart a changed tensor's values are, over the region its changed chunks cover.

    The region is the union of the boxes of side B's chunks that side A lacks, which is also
    the union of side A's chunks that side B lacks (the sides may cut the tensor differently).

    Attributes:
        max_abs_diff: Largest ``|b - a|`` (modulus for complex dtypes).
        l2_diff: L2 norm of ``b - a``.
        l2_a: L2 norm of side A over the same elements (not the whole tensor).
        l2_b: L2 norm of side B over the same elements.
        elements: Number of elements compared (those of the changed region).
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
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


def _numeric(
    snap_a: Snapshot, snap_b: Snapshot, key: str, ea: TensorEntry, eb: TensorEntry
) -> NumericDiff | None:
    """Summarise the changed region of one tensor; None for dtypes without float64 values.

    Chunks are boxes of the global tensor, not byte ranges: a piece of a grid block cut by a
    Shard(1) shard is a strided region of the C-order tensor. So each box of the changed
    region is assembled on both sides from the chunks overlapping it, whatever boxes each
    side cut the tensor into, and the two are compared element by element.
    """
    if not _numeric_dtype(eb.dtype):
        return None
    acc = _Accumulator(eb.dtype)
    side_a, side_b = _BoxReader(snap_a, key, ea), _BoxReader(snap_b, key, eb)
    for box in _changed_boxes(ea, eb):
        acc.add(side_a.region(box), side_b.region(box))
    return acc.result()


def _numeric_dtype(dtype: str) -> bool:
    if dtype.startswith(("bits", "float4")):  # raw bit containers have no numeric value
        return False
    try:
        torch.zeros(1, dtype=dtype_from_name(dtype)).to(torch.float64)
    except (RuntimeError, TypeError):
        return False
    return True


def _changed_boxes(ea: TensorEntry, eb: TensorEntry) -> list[Box]:
    """Disjoint boxes, in C order of their offsets, covering every element that may differ.

    With both sides chunked these are side B's chunks that side A lacks (same box, same id).
    They also cover every chunk of side A that side B lacks: such a chunk ``a`` only overlaps
    changed chunks of B, since a chunk of B present identically in A is a chunk of A, hence
    disjoint from ``a`` (chunks of one side never overlap, see ``manifest.tiling_problem``);
    and B's chunks cover the whole tensor. So when the two sides cut the tensor into different
    boxes (e.g. takes with different world sizes) the region compared is still the union of
    both sides' changed chunks, each element once.
    """
    if ea.inline and eb.inline:
        whole = ((0,) * len(eb.shape), eb.shape)
        return [whole] if math.prod(eb.shape) else []
    if ea.inline or eb.inline:
        return sorted((c.offsets, c.sizes) for c in (ea if eb.inline else eb).chunks)
    same = {(c.offsets, c.sizes, c.id) for c in ea.chunks}
    return sorted((c.offsets, c.sizes) for c in eb.chunks if (c.offsets, c.sizes, c.id) not in same)


class _BoxReader:
    """Assembles boxes of one side's tensor from its verified chunks.

    Boxes must be asked for in C order of their offsets (dim 0 never decreases): a decoded
    chunk is kept only while a later box can still overlap it along dim 0.
    """

    def __init__(self, snap: Snapshot, key: str, entry: TensorEntry) -> None:
        self.snap, self.key, self.entry = snap, key, entry
        self.where = f"snapshot {snap.ref}, key {key!r}"
        inline = entry.data if entry.inline else None
        self.whole = None if inline is None else from_bytes(inline, entry.dtype, entry.shape)
        self.chunks = sorted(entry.chunks, key=lambda c: c.offsets)
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        # the longest extent of a chunk along dim 0: how far back a box's chunks may start
        self.reach = max((c.sizes[0] for c in self.chunks if c.sizes), default=1)
        self.locs: dict[str, Any] | None = None
        self.cache: dict[int, torch.Tensor] = {}

    def region(self, box: Box) -> torch.Tensor:
        """A tensor of ``box``'s sizes holding this side's values there."""
        offs, sizes = box
        if self.whole is not None:
            return self.whole[_slices(offs, (0,) * len(offs), sizes)]
        lo = offs[0] if offs else 0
        self.cache = {i: t for i, t in self.cache.items() if _end0(self.chunks[i]) > lo}
        first = bisect.bisect_left(self.starts, lo - self.reach + 1)
        last = bisect.bisect_left(self.starts, lo + sizes[0]) if offs else len(self.chunks)
        out: torch.Tensor | None = None
        for i in range(first, last):
            c = self.chunks[i]
            inter = _intersect(c.offsets, c.sizes, offs, sizes)
            if inter is None:
                continue
            data = self._chunk(i)
            if inter == box == (c.offsets, c.sizes):
                return data
            if out is None:
                out = empty_for(self.entry.dtype, sizes)
            out[_slices(inter[0], offs, inter[1])] = data[_slices(inter[0], c.offsets, inter[1])]
        if out is None:  # pragma: no cover - a validated manifest's chunks tile the tensor
            raise CorruptionError(f"{self.where}: no chunk covers box {list(offs)}+{list(sizes)}")
        return out

    def _chunk(self, i: int) -> torch.Tensor:
        if i not in self.cache:
            c = self.chunks[i]
            if self.locs is None:
                self.locs = self.snap.store.index.chunk_locations({c.id for c in self.chunks})
            rec = self.locs.get(c.id)
            if rec is None:
                raise CorruptionError(
                    f"{self.where}: chunk {c.id[:16]}… is unknown to the index; "
                    "run `ckstore check`"
                )
            loc = objects.ChunkLocation(
                rec.chunk_id, rec.pack_id, rec.offset, rec.length, rec.raw_length, rec.codec
            )
            t = empty_for(self.entry.dtype, c.sizes)
            self.snap.store.objects.read_chunk(loc, out=writable_view(t))
            self.cache[i] = t
        return self.cache[i]


def _end0(c: ChunkRef) -> int:
    return c.offsets[0] + c.sizes[0] if c.offsets else 1


def _intersect(
    ao: tuple[int, ...], asz: tuple[int, ...], bo: tuple[int, ...], bsz: tuple[int, ...]
) -> Box | None:
    """The overlap of two boxes, or None when it is empty (0-d boxes always overlap)."""
    lo = tuple(max(a, b) for a, b in zip(ao, bo))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(ao, asz, bo, bsz))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _slices(
    offsets: tuple[int, ...], origin: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[slice, ...]:
    """Index of the box (offsets, sizes) inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - r, o - r + n) for o, r, n in zip(offsets, origin, sizes))


class _Accumulator:
    """Running max |b - a| and sums of squares, in float64 (complex128 for complex dtypes)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.wide = torch.complex128 if dtype.startswith("complex") else torch.float64
        self.max_abs = 0.0
        self.sq_diff = self.sq_a = self.sq_b = 0.0
        self.elements = 0

    def add(self, region_a: torch.Tensor, region_b: torch.Tensor) -> None:
        n = region_b.numel()
        if n == 0:
            return
        a = region_a.reshape(-1).to(self.wide)
        b = region_b.reshape(-1).to(self.wide)
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
