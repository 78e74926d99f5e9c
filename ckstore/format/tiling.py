"""Chunk tilings: whether a tensor's chunk boxes cover it exactly once (docs/FORMAT.md, 7.3).

Used wherever chunk lists are read: a whole manifest's entries, a manifest assembled from its
parts, and one rank's region of a tensor (which must be covered by the pieces read for it).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from itertools import pairwise
from typing import Protocol

_HEX64 = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would let a trailing newline in


class Boxed(Protocol):
    """A chunk's box and id (``manifest.ChunkRef``)."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def sizes(self) -> tuple[int, ...]: ...

    @property
    def id(self) -> str: ...


def hex_ids(ids: list[str]) -> bool:
    """True if every id is 64 lowercase hex digits (one pass over all of them at once)."""
    if set(map(len, ids)) - {64}:
        return False
    joined = "".join(ids)
    try:
        # fromhex skips whitespace: an equal digit count rules it out
        digits = 2 * len(bytes.fromhex(joined))
        return joined.isascii() and joined == joined.lower() and digits == len(joined)
    except ValueError:
        return False


def tiling_problem(shape: tuple[int, ...], chunks: Sequence[Boxed]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly once, or None when they do.

    Checked: ids are 64 lowercase hex digits; every box has the tensor's rank and lies inside
    it with positive sizes; the boxes hold as many elements as the tensor; no two boxes overlap.
    Equal element counts plus no overlap means the boxes cover every element exactly once.
    The whole check is O(n log n) in the number of chunks for the tilings ckstore writes
    (see :func:`_overlapping_pair`).
    """
    n, ndim = len(chunks), len(shape)
    if n == 1 and _HEX64.fullmatch(chunks[0].id):  # the common case: one chunk, the whole tensor
        c = chunks[0]
        if c.offsets == (0,) * ndim and c.sizes == shape and 0 not in shape:
            return None
    if not hex_ids([c.id for c in chunks]):
        bad = next(c.id for c in chunks if not (type(c.id) is str and _HEX64.fullmatch(c.id)))
        return f"chunk id {str(bad)[:80]!r} is not 64 lowercase hex digits"
    offs = [c.offsets for c in chunks]
    sizes = [c.sizes for c in chunks]
    if {*map(len, offs), *map(len, sizes)} - {ndim}:
        c = next(c for c in chunks if len(c.offsets) != ndim or len(c.sizes) != ndim)
        return f"chunk {_box(c)} does not have the {ndim} dimensions of shape {list(shape)}"
    ocols: list[tuple[int, ...]] = list(zip(*offs)) if n and ndim else [()] * ndim
    scols: list[tuple[int, ...]] = list(zip(*sizes)) if n and ndim else [()] * ndim
    ecols: list[list[int]] = []
    for d, extent in enumerate(shape):
        e_d = list(map(operator.add, ocols[d], scols[d]))
        if n and (min(ocols[d]) < 0 or min(scols[d]) <= 0 or max(e_d) > extent):
            c = next(
                c for c in chunks if not 0 <= c.offsets[d] < c.offsets[d] + c.sizes[d] <= extent
            )
            return f"chunk {_box(c)} lies outside shape {list(shape)}"
        ecols.append(e_d)
    volumes = [1] * n
    for s_d in scols:
        volumes = list(map(operator.mul, volumes, s_d))
    covered, total = sum(volumes), math.prod(shape)
    if covered != total:
        return f"chunks cover {covered} of {total} elements"
    pair = _overlapping_pair(offs, ocols, ecols)
    if pair is not None:
        return f"chunks {_box(chunks[pair[0]])} and {_box(chunks[pair[1]])} overlap"
    return None


def _overlapping_pair(
    offs: list[tuple[int, ...]], ocols: list[tuple[int, ...]], ecols: list[list[int]]
) -> tuple[int, int] | None:
    """Indices of two overlapping boxes (given per box and per dimension), or None.

    Fast path: the boxes ckstore writes are grid blocks cut by shard boxes. Both are product
    partitions of the tensor, so every box is one cell of the partition whose cut points, per
    dimension, are all box starts and ends: each box spans exactly one gap between consecutive
    cut points in every dimension. Boxes that are single cells overlap only if they are the same
    cell, i.e. start at the same offsets. Other tilings fall back to a sweep along the dimension
    with the most distinct starts, comparing each box with the boxes still open there.
    """
    if len(offs) < 2:
        return None
    first: dict[tuple[int, ...], int] = {}
    for i, o in enumerate(offs):
        j = first.setdefault(o, i)
        if j != i:
            return j, i
    if all(_single_cells(o_d, e_d) for o_d, e_d in zip(ocols, ecols)):
        return None
    return _sweep(ocols, ecols)


def _single_cells(starts: tuple[int, ...], ends: list[int]) -> bool:
    """True if each interval [start, end) runs from one cut point to the next one."""
    points = sorted({*starts, *ends})
    following = dict(pairwise(points))
    return list(map(following.__getitem__, starts)) == ends


def _sweep(ocols: list[tuple[int, ...]], ecols: list[list[int]]) -> tuple[int, int] | None:
    ndim = len(ocols)
    d = max(range(ndim), key=lambda k: len(set(ocols[k])))
    starts, ends = ocols[d], ecols[d]
    active: list[int] = []
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        active = [j for j in active if ends[j] > starts[i]]
        for j in active:
            if all(ocols[k][i] < ecols[k][j] and ocols[k][j] < ecols[k][i] for k in range(ndim)):
                return j, i
        active.append(i)
    return None


def _box(c: Boxed) -> str:
    return f"{list(c.offsets)}+{list(c.sizes)}"


def uncovered(offsets: tuple[int, ...], sizes: tuple[int, ...], chunks: Sequence[Boxed]) -> int:
    """Elements of the box ``offsets``/``sizes`` that ``chunks`` leave uncovered (0: covered).

    For chunks of one valid tiling (no two overlap; a box listed twice counts once): what a
    reader that holds only the chunks of its own region checks before it reads them.
    """
    covered = 0
    for box in {(tuple(c.offsets), tuple(c.sizes)) for c in chunks}:
        volume = 1
        for o, s, ro, rs in zip(*box, offsets, sizes):
            volume *= max(0, min(o + s, ro + rs) - max(o, ro))
        covered += volume
    return math.prod(sizes) - covered
