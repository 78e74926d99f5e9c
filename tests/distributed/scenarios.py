"""What each rank runs in the distributed tests (imported in forked children)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ckstore
from ckstore.errors import DistributedError
from ckstore.format.boxes import local_box
from tests.support.states import bits, random_tensor

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
F32, BF16 = torch.float32, torch.bfloat16
SPECS = {
    "rep": ((12, 40), F32),
    "s0": ((37, 24), F32),
    "s1": ((20, 33), F32),
    "mesh": ((18, 26), F32),
    "uneven": ((10, 16), F32),  # 3,3,3,1 rows on 4 ranks
    "empty": ((2, 40), F32),  # 1,1,0,0 rows on 4 ranks
    "bf": ((9, 70), BF16),
}


def global_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {k: random_tensor(dtype, shape, gen) for k, (shape, dtype) in SPECS.items()}


def _pl(world: int, take: bool) -> dict[str, tuple[tuple[int, ...], list[Any]]]:
    from torch.distributed.tensor import Replicate, Shard

    one = (world,)
    if take:
        mesh = ((2, 2), [Shard(0), Shard(1)]) if world == 4 else (one, [Shard(1)])
        return {
            "rep": (one, [Replicate()]),
            "s0": (one, [Shard(0)]),
            "s1": (one, [Shard(1)]),
            "mesh": mesh,
            "uneven": (one, [Shard(0)]),
            "empty": (one, [Shard(0)]),
            "bf": (one, [Shard(1)]),
        }
    mesh = ((2, 2), [Replicate(), Shard(1)]) if world == 4 else (one, [Shard(0)])
    return {
        "rep": (one, [Shard(0)]),
        "s0": (one, [Shard(1)]),
        "s1": (one, [Shard(0)]),
        "mesh": mesh,
        "uneven": (one, [Shard(0)]),
        "empty": (one, [Shard(0)]),
        "bf": (one, [Shard(0)]),
    }


_MESHES: dict[tuple[int, ...], Any] = {}


def mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def dtensors(world: int, take: bool, zeros: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    g = global_state()
    out = {}
    for k, (shape, placements) in _pl(world, take).items():
        src = torch.zeros_like(g[k]) if zeros else g[k]
        out[k] = distribute_tensor(src, mesh(shape), placements, src_data_rank=None)
    return out


def local_app(rank: int) -> ckstore.StateDict:
    """Per-rank values (a tensor and an int that differ by rank) and values equal everywhere."""
    return ckstore.StateDict(
        mine=torch.full((6, 50), float(rank)) + torch.arange(50.0),
        small=torch.tensor([rank, rank + 1]),
        rank=rank,
        same_t=torch.arange(300.0),
        same=7,
    )


def check_local(app: ckstore.StateDict, rank: int) -> None:
    want = local_app(rank)
    for k in ("mine", "small", "same_t"):
        assert bits(app[k]) == bits(want[k]), k
    assert app["rank"] == rank and app["same"] == 7


def check_global(dest: dict[str, Any]) -> None:
    g = global_state()
    for k, d in dest.items():
        if isinstance(d, torch.Tensor) and type(d) is torch.Tensor:
            assert bits(d) == bits(g[k]), k
            continue
        offs, sizes = local_box(d)
        want = g[k][tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        assert bits(d.to_local()) == bits(want), (k, offs, sizes)


def take_dtensors(rank: int, world: int, path: str, run: str) -> str:
    store = ckstore.open(path, **TINY, create=True)
    snap = store.take(
        {"g": ckstore.StateDict(dtensors(world, True, False)), "local": local_app(rank)},
        run=run,
        step=world,
    )
    return snap.id


def restore_dtensors(rank: int, world: int, path: str, runs: dict[str, int]) -> None:
    """Restore each run (taken with ``runs[run]`` ranks) into other placements; check bits."""
    store = ckstore.open(path, **TINY, create=True)
    for run, took in runs.items():
        dest = ckstore.StateDict(dtensors(world, False, True))
        app = {"g": dest}
        local = ckstore.StateDict(
            {
                k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1)
                for k, v in local_app(rank).items()
            }
        )
        if world <= took:
            app["local"] = local
        store.get(run).restore(app, strict=False)
        check_global(dest)
        if world <= took:
            check_local(local, rank)


def matrix_take(rank: int, world: int, path: str, runs: dict[str, int]) -> dict[str, Any]:
    sid = take_dtensors(rank, world, path, f"w{world}")
    restore_dtensors(rank, world, path, {**runs, f"w{world}": world})
    out: dict[str, Any] = {"id": sid}
    fewer = [
        run for run, took in runs.items() if 1 < took < world
    ]  # a plain process keeps no per-rank values
    if fewer:
        out["per_rank_error"] = _per_rank_too_few(rank, world, path, fewer[0])
    return out


def _per_rank_too_few(rank: int, world: int, path: str, run: str) -> str:
    """Restoring per-rank entries onto more ranks than the take had, strict: every rank raises."""
    store = ckstore.open(path, **TINY, create=True)
    app = ckstore.StateDict(
        {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1)
            for k, v in local_app(rank).items()
        }
    )
    try:
        store.get(run).restore({"local": app}, strict=True)
    except DistributedError as exc:
        assert float(app["mine"].abs().sum()) == 0.0  # untouched on every rank
        return str(exc)
    raise AssertionError("restore of per-rank entries onto missing ranks did not fail")


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40), torch.nn.Linear(40, 8)
    )


def ddp_take(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    store = ckstore.open(path, **TINY, create=True)
    m = DistributedDataParallel(model(5))
    snap = store.take({"ddp": m}, run="ddp")
    fresh = DistributedDataParallel(model(6))
    store.get("ddp").restore({"ddp": fresh})
    for (k, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert bits(a) == bits(b), k
    return {"ranks": snap.manifest.snapshot["ranks"] if rank == 0 else None, "stats": snap.stats}


def fsdp_take(rank: int, world: int, path: str, expect: str) -> None:
    from torch.distributed.fsdp import fully_shard

    store = ckstore.open(path, **TINY, create=True)
    m, opt = _fsdp(7)
    store.take({"model": m, "optim": opt}, run="fsdp")
    full = {f"model/{k}": v.full_tensor() for k, v in m.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            full[f"optim/{pid}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    if rank == 0:
        torch.save(full, expect)
    del fully_shard


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    m = model(seed)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    torch.manual_seed(seed + 100)
    m(torch.randn(4, 48)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def fsdp_restore(rank: int, world: int, path: str, expect: str) -> None:
    m, opt = _fsdp(99)  # other values, same structure; optimizer state exists after one step
    ckstore.open(path, **TINY, create=True).get("fsdp").restore({"model": m, "optim": opt})
    full = torch.load(expect, weights_only=True)
    for k, v in m.state_dict().items():
        assert bits(v.full_tensor()) == bits(full[f"model/{k}"]), k
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert bits(got) == bits(full[f"optim/{pid}/{k}"]), (pid, k)


def failing_take(
    rank: int, world: int, path: str, bad: int, how: str, timeout: float
) -> dict[str, Any]:
    """Rank ``bad`` raises (or is SIGKILLed) while writing its chunks."""
    store = ckstore.open(path, **TINY, create=True)
    if rank == bad:
        real = store.repository.objects.new_pack_writer

        def broken(*a: Any, **k: Any) -> Any:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "stop":  # alive but stuck: only the timeout can save the others
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("injected failure while writing")

        store.repository.objects.new_pack_writer = broken  # type: ignore[method-assign]
        del real
    state = {"g": ckstore.StateDict(dtensors(world, True, False)), "local": local_app(rank)}
    t0 = time.monotonic()
    try:
        store.take(state, run="fail", dist_timeout=timeout)
    except DistributedError as exc:
        return {
            "error": str(exc),
            "seconds": time.monotonic() - t0,
            "ranks": getattr(exc, "ranks", None),
        }
    return {"error": None, "seconds": time.monotonic() - t0}


def async_take(rank: int, world: int, path: str) -> dict[str, Any]:
    """async_take on every rank: staged now, committed together in the background."""
    store = ckstore.open(path, **TINY, create=True)
    g = dtensors(world, True, False)
    pending = store.async_take({"g": ckstore.StateDict(g), "local": local_app(rank)}, run="async")
    for d in g.values():
        d.to_local().zero_()  # training moves on; the snapshot keeps the staged state
    snap = pending.wait(120)
    dest = ckstore.StateDict(dtensors(world, False, True))
    store.get("async").restore({"g": dest})
    check_global(dest)
    return {"id": snap.id}


def restore_after(
    rank: int, world: int, path: str, runs: dict[str, int], expect: str
) -> dict[str, Any]:
    restore_dtensors(rank, world, path, runs)
    fsdp_restore(rank, world, path, expect)
    return {
        "fail": failing_take(rank, world, path, 1, "raise", 600),
        "async": async_take(rank, world, path),
    }


def replicated_restore(rank: int, world: int, path: str) -> dict[str, Any]:
    """Restore a DDP take with each replicated_read mode: bits, and pack reads per rank
    (and with atomic=False in each mode: bits).

    Then a read failure on rank 0 in the default mode: every rank raises, nothing loaded.
    """
    from torch.nn.parallel import DistributedDataParallel

    from ckstore import objects
    from ckstore.distributed import _readplan, comm

    comm.BROADCAST_BATCH = 1000  # many batches, some packed, some slices of one tensor
    _readplan.ROUND_BYTES = 4096  # many exchange rounds and broadcast batches
    want = DistributedDataParallel(model(5)).state_dict()
    store = ckstore.open(path, create=True)
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    snap = store.get("ddp")
    _ = snap.manifest
    out: dict[str, Any] = {}
    for mode in ("each", "once", "broadcast"):
        _readplan.FANOUT = (
            1 if mode == "broadcast" else 8
        )  # "broadcast": the broadcast batches' path
        fresh = DistributedDataParallel(model(6))
        counting.reset()
        snap.restore(
            {"ddp": fresh}, replicated_read=mode, memory_budget=1 << 30
        )  # all staged: one read
        out[mode] = sum(g.nbytes for g in counting.gets if g.name.startswith("packs/"))
        for (k, a), b in zip(want.items(), fresh.state_dict().values()):
            assert bits(a) == bits(b), (mode, k)
    for mode in ("each", "once"):  # atomic=False: one pass straight into place, same bits
        fresh = DistributedDataParallel(model(6))
        snap.restore({"ddp": fresh}, replicated_read=mode, atomic=False, memory_budget=0)
        for (k, a), b in zip(want.items(), fresh.state_dict().values()):
            assert bits(a) == bits(b), ("atomic=False", mode, k)
    os.environ["CKSTORE_REPLICATED_READ"] = "broadcast"
    fresh = DistributedDataParallel(model(6))
    before = {k: bits(v) for k, v in fresh.state_dict().items()}
    if rank == 0:
        from ckstore.errors import CorruptionError

        def broken(*a: Any, **k: Any) -> Any:
            raise CorruptionError("injected damaged chunk")

        # every way this rank's object stores read a chunk (a restore may read through an
        # object store of its own, over a backend that keeps what its first pass read)
        from ckstore.objects import ObjectStore

        for name in (
            "read_chunk",
            "verify_chunk",
            "check_payloads",
            "load_kept",
            "load_verified",
            "load_digested",
        ):
            setattr(ObjectStore, name, broken)
    try:
        snap.restore({"ddp": fresh})
        out["error"] = None
    except DistributedError as exc:
        out["error"] = str(exc)
    finally:
        del os.environ["CKSTORE_REPLICATED_READ"]
    out["untouched"] = all(bits(v) == before[k] for k, v in fresh.state_dict().items())
    return out
