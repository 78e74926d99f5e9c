"""What each rank runs in the DCP backend tests (imported in forked children)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

import ckstore
from ckstore.format.boxes import local_box
from tests.support.states import bits, random_tensor

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
SPECS = {
    "w": ((37, 24), torch.float32),
    "uneven": ((10, 16), torch.float32),  # 3,3,3,1 rows on 4 ranks
    "empty": ((2, 40), torch.float32),  # 1,1,0,0 rows on 4 ranks
    "bf": ((9, 70), torch.bfloat16),
}


def global_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    out = {k: random_tensor(dtype, shape, gen) for k, (shape, dtype) in SPECS.items()}
    out["plain"] = random_tensor(
        torch.float32, (30, 20), gen
    )  # a plain tensor, the same on every rank
    return out


_MESHES: dict[int, Any] = {}


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESHES:
        _MESHES[world] = init_device_mesh("cpu", (world,))
    return _MESHES[world]


def sharded(world: int, placement: str, zeros: bool) -> dict[str, Any]:
    """The global state as DTensors on a 1-D cpu mesh (``placement``: shard0, shard1, replicate)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    pl = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement]
    out: dict[str, Any] = {}
    for k, t in global_state().items():
        src = torch.zeros_like(t) if zeros else t
        out[k] = (
            src.clone()
            if k == "plain"
            else distribute_tensor(src, _mesh(world), [pl], src_data_rank=None)
        )
    return out


def check(state: dict[str, Any]) -> None:
    g = global_state()
    for k, v in state.items():
        if type(v) is torch.Tensor:
            assert bits(v) == bits(g[k]), k
            continue
        offs, sizes = local_box(v)
        want = g[k][tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        assert bits(v.to_local()) == bits(want), (k, offs, sizes)


def save_twice(rank: int, world: int, path: str, run: str) -> dict[str, Any]:
    """dcp.save the Shard(0) state twice; the coordinator reports both snapshots' figures."""
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    store = ckstore.open(path, **TINY, create=True)
    out: dict[str, Any] = {}
    for step in (1, 2):
        state = {
            "g": sharded(world, "shard0", zeros=False),
            "epoch": 5,
            "cfg": {"lr": 0.1, "name": "x"},
        }
        w = StorageWriter(store, run=run, step=step)
        dcp.save(state, storage_writer=w)
        if w.snapshot is not None:
            r = w.snapshot.record
            out[str(step)] = {
                "id": r.id,
                "new_bytes": r.new_bytes,
                "new_chunks": r.new_chunks,
                "world": r.world_size,
            }
    out["failed"] = _save_refused(store, world, run)
    out["live_sessions"] = len(store.repository.index.live_sessions())
    out["gc"] = _gc_before_commit(rank, world, path + "-gc")
    return out


def _gc_before_commit(rank: int, world: int, path: str) -> dict[str, Any] | None:
    """Into a fresh store: the coordinator runs gc(grace 0) in finish, just before committing.

    By then the other ranks have ended their sessions; the coordinator's pins must keep every
    chunk of the save (nothing unreferenced and unpinned), so the commit succeeds and checks clean.
    """
    import time

    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    store = ckstore.open(path, **TINY, create=True)
    seen: dict[str, Any] = {}

    class GcFirst(StorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            seen["chunks"] = sum(1 for _ in store.repository.index.all_chunks())
            seen["unprotected"] = len(store.repository.index.unreferenced_chunks(time.time() + 1))
            seen["live_sessions"] = len(store.repository.index.live_sessions())
            seen["removed"] = store.gc(grace_seconds=0).chunks_removed
            super().finish(metadata, results)

    w = GcFirst(store, run="gc", step=1)
    dcp.save({"g": sharded(world, "shard0", zeros=False)}, storage_writer=w)
    if w.snapshot is None:
        return None
    seen["check"] = store.check(read_data=True).ok
    return seen


def _save_refused(store: Any, world: int, run: str) -> str:
    """A value ckstore cannot store (a set): every rank raises, nothing is committed."""
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    before = len(store.log(run))
    try:
        dcp.save(
            {"g": sharded(world, "shard0", zeros=False), "bad": {1, 2}},
            storage_writer=StorageWriter(store, run=run, step=9),
        )
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
        assert len(store.log(run)) == before
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_each(rank: int, world: int, path: str, loads: list[list[str]]) -> list[dict[str, Any]]:
    """``load`` once per ``[ref, placement]`` in one spawn of ranks."""
    return [load(rank, world, path, ref, placement) for ref, placement in loads]


def load(rank: int, world: int, path: str, ref: str, placement: str) -> dict[str, Any]:
    """dcp.load into ``placement`` DTensors with pickle.load/loads disabled; check the bits."""
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageReader

    store = ckstore.open(path, create=True)
    state = {
        "g": sharded(world, placement, zeros=True),
        "epoch": -1,
        "cfg": {"lr": 0.0, "name": ""},
    }

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle used while loading")

    saved = pickle.load, pickle.loads
    pickle.load, pickle.loads = refuse, refuse  # type: ignore[assignment]
    try:
        dcp.load(state, storage_reader=StorageReader(store, ref))
    finally:
        pickle.load, pickle.loads = saved  # type: ignore[assignment]
    check(state["g"])
    # the same DCP snapshot through ckstore's own restore: app "g" maps onto DCP keys g.<name>
    again = ckstore.StateDict(sharded(world, placement, zeros=True))
    store.get(ref).restore({"g": again})
    check(dict(again))
    return {"epoch": state["epoch"], "cfg": state["cfg"]}


class TrainState:
    """A trainer's progress as DCP users keep it: tensors plus a loss history in an io.BytesIO."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step = step
        self.losses = list(losses or [])

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step), "losses": buf}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        sd["losses"].seek(0)
        self.losses = torch.load(sd["losses"], weights_only=True)


def parity(rank: int, world: int, path: str) -> dict[str, Any]:
    """overwrite=False, BytesIO values, async_save with the thread and the process executor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ckstore.dcp import StorageReader, StorageWriter

    store = ckstore.open(path, create=True)
    weights = global_state()["plain"]
    state = {"w": weights.clone(), "train": TrainState(7, [0.5, 0.25])}
    dcp.save(state, storage_writer=StorageWriter(store, run="p", step=1, overwrite=False))
    out: dict[str, Any] = {}
    try:
        dcp.save(state, storage_writer=StorageWriter(store, run="p", step=1, overwrite=False))
        out["refused"] = None
    except BaseException as exc:  # noqa: BLE001 - DCP wraps it in a CheckpointException
        out["refused"] = f"{type(exc).__name__}: {exc}"
    fresh = {"w": torch.zeros_like(weights), "train": TrainState()}
    dcp.load(fresh, storage_reader=StorageReader(store, "p@1"))
    out["loaded"] = [fresh["train"].step, fresh["train"].losses, bits(fresh["w"]) == bits(weights)]
    # thread executor with a writer given the store's URL; process executor with one holding the
    # open store: it is pickled into the checkpoint process and reopens the store there
    for step, kind, where in (
        (2, AsyncCheckpointerType.THREAD, path),
        (3, AsyncCheckpointerType.PROCESS, store),
    ):
        state["train"].losses.append(float(step))
        writer = StorageWriter(where, run="p", step=step)
        fut = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind)
        fut.result(timeout=120)
    later = {"w": torch.zeros_like(weights), "train": TrainState()}
    dcp.load(later, storage_reader=StorageReader(path, "p@3"))
    out["async"] = [later["train"].losses, bits(later["w"]) == bits(weights)]
    out["steps"] = sorted(s.step for s in store.log("p"))
    from torch.distributed.checkpoint import _async_process_executor as executor

    if executor._CHECKPOINT_PROCESS is not None:  # stop DCP's checkpoint process cleanly
        executor._CHECKPOINT_PROCESS.__del__()
        executor._CHECKPOINT_PROCESS = None
    return out


def subgroup_saves(rank: int, world: int, path: str) -> dict[str, Any]:
    """Ranks {0, 2} dcp.save a Shard(0) state over their sub-group while ranks {1, 3} take
    something else with store.take(pg=...) at the same time: two snapshots of 2 ranks each."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckstore.dcp import StorageWriter

    groups = {0: dist.new_group([0, 2]), 1: dist.new_group([1, 3])}  # every rank creates both
    mine = groups[rank % 2]
    store = ckstore.open(path, **TINY)
    if rank % 2 == 0:
        mesh = DeviceMesh.from_group(mine, "cpu")
        state = {
            "g": {
                k: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
                for k, t in global_state().items()
                if k != "plain"
            },
            "epoch": 5,
        }
        w = StorageWriter(store, run="sub02", step=1)
        dcp.save(state, storage_writer=w, process_group=mine)
        out = {
            "id": w.snapshot.id if w.snapshot is not None else None,
            "world": w.snapshot.record.world_size if w.snapshot else None,
        }
    else:
        snap = store.take(
            {"s": ckstore.StateDict(x=torch.full((50, 8), float(rank)), n=rank)},
            run="sub13",
            pg=mine,
        )
        out = {"id": snap.id, "world": snap.record.world_size}
    # Rank 0 hosts the job's rendezvous store, which the other sub-group's ckstore group talks
    # through: as in any torch job, no rank leaves before the others are done.
    dist.barrier()
    return out
