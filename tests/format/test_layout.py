"""Layouts (docs/FORMAT.md 7.7): every rank's box as DTensor computes it, and the parts a
region's pieces are recorded in, as the distributed take assigns them."""

from __future__ import annotations

import itertools
import math

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckstore.errors import CorruptionError
from ckstore.format.boxes import pieces
from ckstore.format.grid import make_grid
from ckstore.format.layout import Layout, writer

CASES = [
    ((8,), (0,), (10,)),
    ((3,), (0,), (10, 4)),
    ((4,), (1,), (5, 7)),
    ((16,), (0,), (5, 3)),  # more ranks than rows: empty shards
    ((2, 2), (0, None), (10, 3)),
    ((2, 3), (None, 1), (4, 11)),
    ((2, 2), (0, 1), (7, 9)),
    ((2, 2), (0, 0), (13, 2)),  # one dimension sharded twice
    ((2, 2, 2), (0, None, 1), (9, 5, 4)),
]


@pytest.mark.parametrize(("mesh", "placements", "shape"), CASES)
def test_every_box_is_the_one_dtensor_gives(
    mesh: tuple[int, ...], placements: tuple[int | None, ...], shape: tuple[int, ...]
) -> None:
    layout = Layout(mesh, placements)
    torch_placements = [Replicate() if d is None else Shard(d) for d in placements]
    for coord in itertools.product(*(range(n) for n in mesh)):
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), torch_placements
        )
        assert layout.box(shape, coord) == (tuple(offsets), tuple(sizes)), coord


@pytest.mark.parametrize(("mesh", "placements", "shape"), CASES)
def test_writers_are_the_ranks_that_write_the_pieces(
    mesh: tuple[int, ...], placements: tuple[int | None, ...], shape: tuple[int, ...]
) -> None:
    """For every region, the parts the layout names hold every piece overlapping it: the
    take's rule (piece j of a box to holder (j + crc32(key)) % n) run over every rank."""
    layout = Layout(mesh, placements, tuple(reversed(range(math.prod(mesh)))))
    grid = make_grid(shape, 4, 8)
    key = "m/w"
    recorded: dict[tuple[object, ...], int] = {}
    coords = list(itertools.product(*(range(n) for n in mesh)))
    for coord in coords:
        box = layout.box(shape, coord)
        holders = sorted(layout.rank_at(c) for c in coords if layout.box(shape, c) == box)
        for j, piece in enumerate(pieces(grid, box)):
            recorded[piece] = writer(key, j, holders)
    assert sum(math.prod(p[1]) for p in recorded) == math.prod(shape)
    for lo in range(shape[0]):
        for hi in range(lo + 1, shape[0] + 1):
            region = ((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])
            want = {
                r
                for (o, s), r in recorded.items()
                if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(o, s, *region))
            }
            assert layout.writers(key, grid, region) == want, region


def test_holdings_visit_only_overlapping_boxes() -> None:
    layout = Layout((8192,), (0,))
    found = list(layout.holdings((32000, 16), ((98, 0), (3, 16))))
    assert found == [(((96, 0), (4, 16)), [24]), (((100, 0), (4, 16)), [25])]


def test_malformed_layouts_are_refused() -> None:
    for bad in (
        {"mesh": [], "placements": []},
        {"mesh": [2], "placements": [0, 1]},
        {"mesh": [2], "placements": [-1]},
        {"mesh": [2], "placements": [True]},
        {"mesh": [2, 2], "placements": [0, None], "ranks": [0, 1, 2]},
        {"mesh": [2], "placements": [0], "ranks": [1, 1]},
        {"placements": [0]},
    ):
        with pytest.raises(CorruptionError, match="layout"):
            Layout.from_dict(bad, "root")
    assert Layout.from_dict({"mesh": [2], "placements": [0]}, "root") == Layout((2,), (0,))
    with pytest.raises(CorruptionError, match="dimension 1 of a 1-dimensional"):
        list(Layout((2,), (1,)).holdings((4,), ((0,), (4,))))
