"""Layouts: which rank of a take holds which box of a sharded tensor, and which rank recorded
which of its pieces (docs/FORMAT.md, section 7.7).

A layout is what a DTensor's sharding says, written down: its device mesh (the mesh's shape and
the take's rank at each coordinate, in C order) and, per mesh dimension, the tensor dimension
it shards or None where it replicates. From it any reader computes, torch-free, every rank's
shard box (each sharded dimension split as ``torch.chunk`` splits it, mesh dimensions in order),
the ranks holding the same box, and among them the one that wrote each piece (:func:`writer`).
So a rank restoring one region of a tensor reads the parts of the few ranks whose pieces
overlap it, never every rank's part.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptionError
from .boxes import pieces
from .grid import Box, Grid

MAX_MESH_DIMS = 8


def writer(key: str, j: int, holders: Sequence[int]) -> int:
    """The rank among ``holders`` (sorted, the ranks holding one shard box of ``key``) that
    writes and records piece ``j`` of that box (its grid blocks cut to the box, in the order of
    :func:`~ckstore.format.boxes.pieces`): the ``(j + crc32(key)) mod n``-th of them."""
    spin = zlib.crc32(key.encode()) % len(holders)
    return holders[(j + spin) % len(holders)]


@dataclass(frozen=True)
class Layout:
    """A sharded tensor's mesh and placements (see the module docstring)."""

    mesh: tuple[int, ...]
    placements: tuple[int | None, ...]
    ranks: tuple[int, ...] | None = None
    """The take's rank at each mesh coordinate, in C order of the coordinates; None: the
    identity (coordinate ``i`` in C order is rank ``i``)."""

    @property
    def size(self) -> int:
        return math.prod(self.mesh)

    def rank_at(self, coord: Sequence[int]) -> int:
        flat = 0
        for c, n in zip(coord, self.mesh):
            flat = flat * n + c
        return self.ranks[flat] if self.ranks is not None else flat

    def box(self, shape: Sequence[int], coord: Sequence[int]) -> Box:
        """The shard box of the rank at mesh coordinate ``coord``."""
        offs, sizes = [0] * len(shape), list(shape)
        for m, d in enumerate(self.placements):
            if d is None:
                continue
            lo, hi = _split(sizes[d], self.mesh[m], coord[m])
            offs[d] += lo
            sizes[d] = hi - lo
        return tuple(offs), tuple(sizes)

    def holdings(self, shape: Sequence[int], region: Box) -> Iterator[tuple[Box, list[int]]]:
        """Every shard box that overlaps ``region``, with the ranks holding it (sorted); only
        the boxes that overlap are visited."""
        self._check_dims(len(shape))
        if any(s == 0 for s in region[1]) or any(s == 0 for s in shape):
            return
        free = [m for m, d in enumerate(self.placements) if d is None]
        for box, coord in self._walk(0, (), [0] * len(shape), list(shape), region):
            holders = set()
            for values in itertools.product(*(range(self.mesh[m]) for m in free)):
                full = list(coord)
                for m, v in zip(free, values):
                    full[m] = v
                holders.add(self.rank_at(full))
            yield box, sorted(holders)

    def writers(self, key: str, grid: Grid, region: Box) -> set[int]:
        """The ranks whose parts record the pieces of ``key`` that overlap ``region``."""
        out: set[int] = set()
        for box, holders in self.holdings(grid.shape, region):
            if len(holders) == 1:
                out.add(holders[0])
                continue
            for j, piece in enumerate(pieces(grid, box)):
                if _overlap(piece, region):
                    out.add(writer(key, j, holders))
        return out

    def _walk(
        self, m: int, coord: tuple[int, ...], offs: list[int], sizes: list[int], region: Box
    ) -> Iterator[tuple[Box, tuple[int, ...]]]:
        if m == len(self.mesh):
            yield (tuple(offs), tuple(sizes)), coord
            return
        d = self.placements[m]
        if d is None:  # replicated here: coordinate 0 stands for every one (holders)
            yield from self._walk(m + 1, coord + (0,), offs, sizes, region)
            return
        n, full = self.mesh[m], sizes[d]
        step = -(-full // n)
        if step == 0:
            return
        ro, rs = region[0][d], region[1][d]
        for i in range(
            max(0, (ro - offs[d]) // step), min(n - 1, (ro + rs - 1 - offs[d]) // step) + 1
        ):
            lo, hi = _split(full, n, i)
            if hi <= lo or max(offs[d] + lo, ro) >= min(offs[d] + hi, ro + rs):
                continue
            o2, s2 = list(offs), list(sizes)
            o2[d] += lo
            s2[d] = hi - lo
            yield from self._walk(m + 1, coord + (i,), o2, s2, region)

    def _check_dims(self, ndim: int) -> None:
        bad = [d for d in self.placements if d is not None and d >= ndim]
        if bad:
            raise CorruptionError(
                f"layout shards tensor dimension {bad[0]} of a {ndim}-dimensional tensor"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mesh": list(self.mesh), "placements": list(self.placements)}
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Layout:
        """Parse and check a layout; CorruptionError naming ``where`` if it is malformed."""
        try:
            mesh = tuple(d["mesh"])
            placements = tuple(d["placements"])
            ranks = d.get("ranks")
            ok = (
                0 < len(mesh) <= MAX_MESH_DIMS
                and all(type(n) is int and n >= 1 for n in mesh)
                and len(placements) == len(mesh)
                and all(p is None or (type(p) is int and p >= 0) for p in placements)
            )
            if ok and ranks is not None:
                ranks = tuple(ranks)
                ok = (
                    len(ranks) == math.prod(mesh)
                    and all(type(r) is int for r in ranks)
                    and sorted(ranks) == list(range(len(ranks)))
                )
        except (KeyError, TypeError, AttributeError) as exc:
            raise CorruptionError(f"{where}: malformed layout: {exc}") from exc
        if not ok:
            raise CorruptionError(f"{where}: malformed layout {str(d)[:120]}")
        return cls(mesh, placements, ranks)


def _split(full: int, n: int, i: int) -> tuple[int, int]:
    """Shard ``i`` of ``n`` of an extent of ``full``, as ``torch.chunk`` cuts it (the last ones
    may be short or empty)."""
    step = -(-full // n)
    lo = min(i * step, full)
    return lo, min(lo + step, full)


def _overlap(a: Box, b: Box) -> bool:
    return all(
        max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1])
    )
