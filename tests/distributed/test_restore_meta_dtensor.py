"""Restoring into DTensor parameters still on the meta device (an FSDP2-style model built under
``torch.device("meta")`` and sharded, before ``to_empty``) is refused with MismatchError naming
the key, before anything loads. Before, the bytes were copied into the meta local shard (a
no-op): the restore returned normally and every parameter stayed on meta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from tests.support.ranks import run_ranks, values


def _restore_into_meta_dtensor(rank: int, world: int, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.empty(20 // world, 50, device="meta")
    w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(20, 50), stride=(50, 1))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(w)
    try:
        ckstore.open(path).get("r@1").restore({"model": model})
    except (ckstore.errors.MismatchError, ckstore.errors.DistributedError) as exc:
        return {"raised": str(exc)}
    local_now = model.w.to_local()
    return {
        "raised": None,
        "still_meta": local_now.is_meta,
        "ok": (not local_now.is_meta)
        and torch.equal(local_now, torch.arange(1000.0).reshape(20, 50).chunk(world)[rank]),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_restore_into_a_meta_dtensor_is_refused_before_anything_loads(
    tmp_path: Path, world: int
) -> None:
    path = str(tmp_path / "store")
    with ckstore.open(path, create=True) as store:
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.arange(1000.0).reshape(20, 50))
        store.take({"model": m}, run="r", step=1)
    for rank, out in enumerate(
        values(run_ranks(_restore_into_meta_dtensor, world, tmp_path, path))
    ):
        assert out["raised"] is not None, (rank, out)  # before: still on meta, no error
        assert "MismatchError" in out["raised"] or world == 1, out["raised"]
        assert "'model/w'" in out["raised"] and "meta device" in out["raised"]
