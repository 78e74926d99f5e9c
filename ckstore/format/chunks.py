"""Chunk refs: where each chunk of a tensor lies in the global tensor, its id and its check,
as a manifest lists them (docs/FORMAT.md, section 7.3), parsed in bulk (that they tile their
tensor exactly once is :mod:`ckstore.format.tiling`'s check)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
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
