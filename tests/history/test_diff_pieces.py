"""Numeric diffs of tensors stored as shard pieces (boxes that are not byte ranges).

A 2-rank take of a Shard(1) DTensor stores each grid block as two column pieces: strided
regions of the C-order tensor. Takes with other placements or world sizes cut the same tensor
into other boxes. The numeric diff must compare the same elements on both sides in every case.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import ckstore
from tests.support.ranks import run_ranks, values

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
SHAPE = (20, 33)  # 132-byte rows: grid blocks of 7 rows ([0, 7), [7, 14), [14, 20))
CHANGED_ROWS = slice(7, 14)  # both edits fall in the middle block


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[8, 3] += 1.5
    y[9, 20] -= 2.0  # the other Shard(1) column piece, same block
    return x, y


def _sharded_takes(rank: int, world: int, path: str) -> bool:
    """s@1: x as Shard(1); s@2: y as Shard(1); s@3: x as Shard(0) (all on ``world`` ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x, y = _pair()
    store = ckstore.open(path, **TINY, create=True)
    for step, (t, dim) in enumerate([(x, 1), (y, 1), (x, 0)], start=1):
        w = distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None)
        store.take({"m": ckstore.StateDict(w=w)}, run="s", step=step)
    store.close()
    return True


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("pieces")
    path = str(tmp / "store")
    values(run_ranks(_sharded_takes, 2, tmp, path))
    x, y = _pair()
    s = ckstore.open(path, **TINY, create=True)
    s.take({"m": ckstore.StateDict(w=y)}, run="p", step=1)  # whole grid blocks
    s.take({"m": ckstore.StateDict(w=x)}, run="p", step=2)
    yield s
    s.close()


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


def _check(n: Any, a: torch.Tensor, b: torch.Tensor, region: tuple[slice, ...] | slice) -> None:
    d = b.double() - a.double()
    assert n.elements == a[region].numel()
    assert n.max_abs_diff == pytest.approx(float(d.abs().max()), rel=1e-12)
    assert n.l2_diff == pytest.approx(_norm(d), rel=1e-12)
    assert n.l2_a == pytest.approx(_norm(a[region]), rel=1e-12)
    assert n.l2_b == pytest.approx(_norm(b[region]), rel=1e-12)


def test_the_takes_store_pieces(store: Any) -> None:
    chunks = store.get("s@1").manifest.entries["m/w"].chunks
    assert len(chunks) == 6 and {c.sizes[1] for c in chunks} == {17, 16}  # not byte ranges
    assert store.get("s@1").record.world_size == 2


def test_same_cutting_into_column_pieces(store: Any) -> None:
    x, y = _pair()
    k = store.diff("s@1", "s@2", numeric=True)["m/w"]
    assert (k.changed_chunks, k.total_chunks) == (2, 6) and k.reason is None
    _check(k.numeric, x, y, CHANGED_ROWS)


def test_pieces_against_whole_blocks_both_ways(store: Any) -> None:
    x, y = _pair()
    k = store.diff("s@1", "p@1", numeric=True)["m/w"]
    assert k.reason == "chunk grids differ (sharding or chunk size changed)"
    _check(k.numeric, x, y, slice(None))  # no chunk is identical on both sides: all compared
    back = store.diff("p@1", "s@1", numeric=True)["m/w"]
    _check(back.numeric, y, x, slice(None))


def test_row_pieces_against_whole_blocks_compare_only_the_changed_block(store: Any) -> None:
    """Shard(0) on 2 ranks keeps blocks 0 and 2 whole (same ids as the plain take)."""
    x, y = _pair()
    k = store.diff("s@3", "p@1", numeric=True)["m/w"]
    assert (k.changed_chunks, k.total_chunks) == (1, 3)
    _check(k.numeric, x, y, CHANGED_ROWS)


def test_equal_values_cut_differently_are_numerically_equal(store: Any) -> None:
    x, _ = _pair()
    k = store.diff("s@1", "p@2", numeric=True)["m/w"]
    assert k.status == "changed" and k.chunk_fraction == 1.0
    assert k.numeric.max_abs_diff == 0.0 and k.numeric.l2_diff == 0.0
    assert k.numeric.elements == x.numel()
    assert k.numeric.l2_a == k.numeric.l2_b == pytest.approx(_norm(x), rel=1e-12)
    assert math.isfinite(k.numeric.l2_a)
