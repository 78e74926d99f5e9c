"""What each rank runs in the DCP import/export test (imported in forked children)."""

from __future__ import annotations

from typing import Any

from tests.dcp.scenarios import check, sharded


def write_dcp(rank: int, world: int, path: str) -> bool:
    """DCP's own save with its own FileSystemWriter: Shard(0) DTensors, a plain tensor, values."""
    import torch.distributed.checkpoint as dcp

    state = {"model": sharded(world, "shard0", zeros=False), "progress": {"step": 5, "lr": 0.25}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    return True


def restore(rank: int, world: int, path: str, ref: str) -> dict[str, Any]:
    """Restore the imported snapshot into Shard(0) DTensors on this world size; check the bits."""
    import ckstore

    store = ckstore.open(path, create=False)
    model = ckstore.StateDict(sharded(world, "shard0", zeros=True))
    progress = ckstore.StateDict()
    store.get(ref).restore({"model": model, "progress": progress})
    check(dict(model))
    return {"progress": dict(progress)}
