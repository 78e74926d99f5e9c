"""The chunk grid: how a tensor is cut into chunks in global tensor coordinates.

A tensor of ``shape`` is tiled by blocks of ``block`` elements per dimension. The block has the
form ``(1, ..., 1, k, full, ..., full)``: it spans whole trailing dimensions and ``k`` indices of
the first dimension ``d`` whose trailing slab fits in ``chunk_bytes`` (``k`` as large as fits).
For the usual case ``d == 0`` this is "row blocks along dim 0". Every block is therefore one
contiguous byte range of the tensor in C order, and the grid depends only on the global shape,
the dtype and ``chunk_bytes``: never on how the tensor is sharded or on which rank writes it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
Cut = tuple[tuple[int, ...], tuple[int, ...], int, int]  # (offsets, sizes, start, stop)


@dataclass(frozen=True)
class Grid:
    """A block grid over one tensor."""

    shape: tuple[int, ...]
    itemsize: int
    block: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def boxes(self) -> Iterator[Box]:
        """Yield the (offsets, sizes) of every non-empty block, in C order of bytes."""
        if self.nbytes == 0:
            return
        if not self.shape:
            yield (), ()
            return
        yield from _boxes(self.shape, self.block, 0, (), ())

    def byte_range(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int]:
        """Byte range [start, stop) of a block (or a contiguous box) in the C-order tensor."""
        strides = _strides(self.shape)
        start = sum(o * s for o, s in zip(offsets, strides)) * self.itemsize
        return start, start + math.prod(sizes) * self.itemsize


def make_grid(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> Grid:
    """Choose the block for ``shape`` so each block holds at most ``chunk_bytes`` if it can.

    A block never splits an element, so a single element larger than ``chunk_bytes`` (never
    the case for real dtypes) would still be one block.
    """
    shape = tuple(int(s) for s in shape)
    inner = itemsize  # bytes of one index of dimension d (all later dims whole)
    for d in range(len(shape) - 1, -1, -1):
        if inner * shape[d] > chunk_bytes:
            k = max(1, chunk_bytes // inner)
            return Grid(shape, itemsize, (1,) * d + (k,) + shape[d + 1 :])
        inner *= shape[d]
    return Grid(shape, itemsize, tuple(max(1, s) for s in shape))


CUTS_CACHED = 512
"""Shapes whose cuts :func:`cuts` keeps (the oldest forgotten first)."""

CUTS_CACHED_BLOCKS = 64
"""Cuts of more blocks than this are not kept: a tensor of that many chunks costs far more to
copy and hash than to cut, and the cache stays within a few MiB whatever the shapes."""

_CUTS: dict[tuple[tuple[int, ...], int, int], tuple[Grid, tuple[Cut, ...]]] = {}
_CUTS_LOCK = threading.Lock()


def cuts(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[Grid, tuple[Cut, ...]]:
    """The grid of :func:`make_grid` and every block's ``(offsets, sizes, start, stop)``
    (:meth:`Grid.byte_range`), in C order of bytes: what a take cuts a tensor into. Kept for
    shapes of few blocks: a training loop takes tensors of the same shapes take after take."""
    key = (shape, itemsize, chunk_bytes)
    hit = _CUTS.get(key)
    if hit is not None:
        return hit
    grid = make_grid(shape, itemsize, chunk_bytes)
    out = grid, tuple((o, s, *grid.byte_range(o, s)) for o, s in grid.boxes())
    if len(out[1]) <= CUTS_CACHED_BLOCKS:
        with _CUTS_LOCK:
            while len(_CUTS) >= CUTS_CACHED:
                del _CUTS[next(iter(_CUTS))]
            _CUTS[key] = out
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def _boxes(
    shape: tuple[int, ...],
    block: tuple[int, ...],
    d: int,
    offs: tuple[int, ...],
    sizes: tuple[int, ...],
) -> Iterator[Box]:
    if d == len(shape):
        yield offs, sizes
        return
    for start in range(0, shape[d], block[d]):
        size = min(block[d], shape[d] - start)
        yield from _boxes(shape, block, d + 1, offs + (start,), sizes + (size,))
