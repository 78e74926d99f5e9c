"""A region of an inline tensor (one stored inside the manifest: at most ``inline_bytes``) is
read from the region's offset: a snapshot taken in one process restores into sharded DTensors
(each rank its own shard of every small tensor) and ``read_regions`` reads any box of it.
Before, every region was read from the tensor's first element, so every rank got rank 0's
shard of each bias and norm, without a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from tests.support.ranks import run_ranks, values


def test_read_regions_of_an_inline_tensor_honours_the_offset(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "store", create=True) as store:  # default inline_bytes
        store.take({"m": ckstore.StateDict(b=torch.arange(12.0))}, run="r", step=1)
        snap = store.get("r@1")
        entry = snap.get_manifest()["m/b"]
        got = snap.read_regions({"x": entry}, {"x": ((6,), (6,))})["x"]
        # got: tensor([0., 1., 2., 3., 4., 5.])
        assert got.tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]


def _restore_sharded(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    store = ckstore.open(path)
    bias = distribute_tensor(torch.zeros(12), mesh, [Shard(0)])  # 48 bytes: stored inline
    weight = distribute_tensor(torch.zeros(1000), mesh, [Shard(0)])  # 4000 bytes: in chunks
    store.get("r@1").restore({"model": ckstore.StateDict(bias=bias, weight=weight)})
    return {"bias": bias.to_local().tolist(), "weight": weight.to_local().tolist()}


@pytest.mark.parametrize("world", [2, 3])
def test_single_process_snapshot_restores_into_sharded_dtensors(tmp_path: Path, world: int) -> None:
    path = str(tmp_path / "store")
    with ckstore.open(path, create=True) as store:  # default knobs: inline_bytes 2048
        store.take(
            {"model": ckstore.StateDict(bias=torch.arange(12.0), weight=torch.arange(1000.0))},
            run="r",
            step=1,
        )
    got = values(run_ranks(_restore_sharded, world, tmp_path, path))
    for rank, out in enumerate(got):
        assert out["weight"] == torch.arange(1000.0).chunk(world)[rank].tolist(), rank  # holds
        # world 2, rank 1: got [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], want [6.0, ..., 11.0]
        assert out["bias"] == torch.arange(12.0).chunk(world)[rank].tolist(), rank


def test_export_in_row_blocks_of_an_inline_tensor(tmp_path: Path) -> None:
    """The same bug through export: a memory budget below an inline tensor's size reads it in
    row blocks, each of which comes back as the tensor's first rows."""
    with ckstore.open(tmp_path / "store", create=True) as store:
        store.take({"model": ckstore.StateDict(sm=torch.arange(8.0))}, run="r", step=0)
        store.get("r").export(tmp_path / "out", "torch", memory_budget=16)
    (pt,) = [p for p in (tmp_path / "out").iterdir() if p.suffix == ".pt"]
    back = torch.load(pt, weights_only=True)
    # got: tensor([0., 1., 2., 3., 0., 1., 2., 3.])
    assert back["model"]["sm"].tolist() == list(range(8))
