"""Chunk refs: where each chunk of a tensor lies in the global tensor, its id and its check,
as a manifest lists them (docs/FORMAT.md, section 7.3), parsed in bulk and checked to tile
their tensor exactly once."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

_HEX64 = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would let a trailing newline in
_HEX16 = re.compile(r"[0-9a-f]{16}")
_BULK = 16  # chunk lists longer than this are type-checked in bulk


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a tensor: its box in global coordinates, its content id and, from manifest
    version 2, its check (the XXH3-64 of its raw bytes seeded with its id, 16 hex digits:
    what a read verifies; None in a version 1 manifest, whose chunks are verified by id)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    id: str
    check: str | None = None

    def to_list(self) -> list[Any]:
        """``[offsets, sizes, id]``, with the check as a fourth element when there is one."""
        out: list[Any] = [list(self.offsets), list(self.sizes), self.id]
        if self.check is not None:
            out.append(self.check)
        return out


def parse_refs(raw: Any, ndim: int) -> tuple[ChunkRef, ...]:
    """Parse ``[[offsets], [sizes], id]`` triples (with a fourth element, the check, from
    version 2); each list must hold exactly ``ndim`` ints, the check 16 lowercase hex digits.

    The types are checked in bulk (C loops over the whole list), which keeps a manifest with
    thousands of chunks fast to parse; on failure, the first bad ref is named.
    """
    if type(raw) is not list:
        raise ValueError("chunks is not a list")
    if len(raw) > _BULK and set(map(type, raw)) == {list} and len(set(map(len, raw))) == 1:
        width = len(raw[0])
        if width in (3, 4):
            cols = list(zip(*raw))
            offs, sizes, ids = cols[0], cols[1], cols[2]
            checks: Sequence[str | None] = cols[3] if width == 4 else (None,) * len(raw)
            if (
                {*map(type, offs), *map(type, sizes)} == {list}
                and {*map(len, offs), *map(len, sizes)} == {ndim}
                and set(map(type, chain.from_iterable((*offs, *sizes)))) <= {int}
                and set(map(type, ids)) == {str}
                and (width == 3 or _hex16(checks))
            ):
                return tuple(map(ChunkRef, map(tuple, offs), map(tuple, sizes), ids, checks))
    ints = (int,) * ndim  # type() is exact: bools and floats are refused
    out = []
    for item in raw:
        if type(item) is not list or len(item) not in (3, 4):
            raise ValueError(f"chunk {str(item)[:80]} is not [offsets, sizes, id(, check)]")
        o, s, cid = item[:3]
        check = item[3] if len(item) == 4 else None
        lists = type(o) is type(s) is list
        if not (lists and tuple(map(type, o)) == tuple(map(type, s)) == ints and type(cid) is str):
            raise ValueError(f"chunk {str(item)[:80]} is not [offsets, sizes, id] of {ndim} ints")
        if check is not None and not (type(check) is str and _HEX16.fullmatch(check)):
            raise ValueError(f"chunk {str(item)[:80]}: the check is not 16 lowercase hex digits")
        out.append(ChunkRef(tuple(o), tuple(s), cid, check))
    return tuple(out)


def _hex16(checks: Sequence[Any]) -> bool:
    """True if every check is 16 lowercase hex digits (one pass over all of them at once)."""
    if set(map(type, checks)) != {str} or set(map(len, checks)) != {16}:
        return False
    joined = "".join(checks)
    try:
        return (
            joined.isascii()
            and joined == joined.lower()
            and len(bytes.fromhex(joined)) * 2 == len(joined)
        )
    except ValueError:
        return False


def _hex_ids(ids: list[str]) -> bool:
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


def tiling_problem(shape: tuple[int, ...], chunks: Sequence[ChunkRef]) -> str | None:
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
    if not _hex_ids([c.id for c in chunks]):
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


def _box(c: ChunkRef) -> str:
    return f"{list(c.offsets)}+{list(c.sizes)}"
