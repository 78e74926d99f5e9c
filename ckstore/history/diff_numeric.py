"""The numeric summary of one changed tensor: how far apart its values are on both sides.

Only the changed chunks of both sides are read (each one re-hashed against its id) and compared
in float64. Chunks are compared as boxes of the global tensor, so pieces of grid blocks cut by
shard boxes (distributed takes), and two sides cut into different boxes (takes with different
world sizes), compare correctly.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Any

import torch

from ..engine.locations import read_following, to_location
from ..errors import CorruptionError
from ..format.dtypes import dtype_from_name
from ..format.manifest import ChunkRef, TensorEntry
from ..format.tensors import empty_for, from_bytes, writable_view
from .diff_result import NumericDiff

if TYPE_CHECKING:
    from ..engine.interfaces import LocationIndex
    from ..engine.view import SnapshotView

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


def numeric_diff(
    snap_a: SnapshotView, snap_b: SnapshotView, key: str, ea: TensorEntry, eb: TensorEntry
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

    def __init__(self, snap: SnapshotView, key: str, entry: TensorEntry) -> None:
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
            index: LocationIndex = self.snap.repo.index
            if self.locs is None:
                self.locs = index.chunk_locations({c.id for c in self.chunks})
            rec = self.locs.get(c.id)
            if rec is None:
                raise CorruptionError(
                    f"{self.where}: chunk {c.id[:16]}… is unknown to the index; run `ckstore check`"
                )
            t = empty_for(self.entry.dtype, c.sizes)
            out = writable_view(t)
            read_following(  # compaction or gc moved it meanwhile: followed to its place
                index.chunk_locations,
                to_location(rec, self.locs),
                lambda loc: self.snap.repo.objects.read_chunk(loc, out=out),
            )
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
