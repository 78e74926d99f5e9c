"""What each rank runs in the TorchSnapshot-compatibility tests (imported in forked children).

Written from TorchSnapshot's documentation: ``Snapshot.take(pg=sub_group)`` beside ranks
waiting in a barrier, ``replicated=`` globs, RNGState order, elastic restores with
``strict=False``, ``get_state_dict_for_key``, and timeouts that name the missing rank.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import torch

from ckstore import RNGState, Snapshot, StateDict
from ckstore.errors import DistributedError, RankLostError
from tests.support.states import DrawsRandomNumbers, bits


class CountingRNG(RNGState):
    """An RNGState that counts how often it was loaded."""

    loads = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        CountingRNG.loads += 1
        super().load_state_dict(state_dict)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _draws() -> list[float]:
    return [float(torch.rand(1)), random.random(), float(np.random.rand())]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Linear(16, 4))


def _local(rank: int, zeros: bool = False) -> StateDict:
    return StateDict(
        mine=torch.zeros(40) if zeros else torch.full((40,), float(rank)), n=-1 if zeros else rank
    )


def subgroup(rank: int, world: int, path: str, timeout: float) -> dict[str, Any]:
    """Ranks 0 and 1 take on a sub-group while rank 2 waits in a barrier; then all restore."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sub = dist.new_group(ranks=[0, 1], backend="gloo")  # every rank creates it, as torch requires
    src = _model(42)
    opt = torch.optim.Adagrad(src.parameters(), lr=0.01)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    if rank < 2:
        ddp = DDP(src, process_group=sub)
        app = {"ddp": ddp, "optim": opt, "local": _local(rank)}
        snap = Snapshot.take(
            path=f"{path}/sync",
            app_state=app,
            pg=sub,
            replicated=["optim/**"],
            dist_timeout=timeout,
        )
        pending = Snapshot.async_take(
            path=f"{path}/async",
            app_state=app,
            pg=sub,
            replicated=["optim/**"],
            dist_timeout=timeout,
        )
        out["async_id"] = pending.wait(60).id
        out["manifest"] = sorted(snap.get_manifest())
        out["read"] = [snap.read_object("1/local/n"), snap.read_object("0/local/n")]
        out["world_size"] = snap.record.world_size
    dist.barrier()  # rank 2 sat here the whole time
    out["barrier_at"] = time.monotonic() - t0
    # every rank restores (rank 2 was not in the take: replicated entries only, strict=False)
    dst = DDP(_model(777 + rank))
    dst_opt = torch.optim.Adagrad(dst.parameters(), lr=0.5)
    local = _local(rank, zeros=True)
    Snapshot(path=f"{path}/sync").restore(
        {"ddp": dst, "optim": dst_opt, "local": local}, strict=False
    )
    out["model_ok"] = all(
        bits(a) == bits(b)
        for a, b in zip(src.state_dict().values(), dst.module.state_dict().values())
    )
    out["optim_lr"] = dst_opt.param_groups[0]["lr"]
    out["local"] = [local["n"], float(local["mine"][0])]
    out["sd"] = {
        k: (float(v[0]) if isinstance(v, torch.Tensor) else v)
        for k, v in Snapshot(f"{path}/sync").get_state_dict_for_key("local").items()
    }
    # a restore on the sub-group alone, with rank 2 in a barrier again
    if rank < 2:
        again = _local(rank, zeros=True)
        Snapshot(path=f"{path}/sync", pg=sub).restore({"local": again}, dist_timeout=timeout)
        out["sub_restore"] = again["n"]
    dist.barrier()
    return out


def absent(rank: int, world: int, path: str, timeout: float) -> dict[str, Any]:
    """Rank 2 sits in a barrier instead of taking; ranks 0 and 1 must name it in time.

    First while the ranks' ckstore group is not open yet (rank 2 never arrives), then, after
    one take by all three, mid-take (rank 2 is alive, beating, but never reaches the take).
    """
    import torch.distributed as dist

    app = {"s": StateDict(x=torch.arange(10.0))}
    out: dict[str, Any] = {}
    for phase in ("open", "collective"):
        if phase == "collective":
            Snapshot.take(
                path=path, app_state=app, dist_timeout=timeout
            )  # all three: the group opens
        if rank == 2:
            t0 = time.monotonic()
            dist.barrier()  # released once the others gave up on the take
            out[phase] = {"waited": time.monotonic() - t0}
            continue
        t0 = time.monotonic()
        try:
            Snapshot.take(path=path, app_state=app, dist_timeout=timeout)
            out[phase] = {"error": None}
        except RankLostError as exc:
            out[phase] = {
                "error": str(exc),
                "ranks": exc.ranks,
                "timeout_error": isinstance(exc, TimeoutError),
            }  # type: ignore[attr-defined]
        out[phase]["seconds"] = time.monotonic() - t0
        dist.barrier()
    return out


def rng_elastic_take(rank: int, world: int, path: str) -> dict[str, Any]:
    """2 ranks: per-rank RNG (and values) beside a DTensor; RNG order; replicated async_take."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    mesh = init_device_mesh("cpu", (world,))
    g = StateDict(w=distribute_tensor(_global_w(), mesh, [Shard(0)], src_data_rank=None))
    app = {"rng": CountingRNG(), "fx": DrawsRandomNumbers(), "g": g, "local": _local(rank)}
    snap = Snapshot.take(path=f"{path}/elastic", app_state=app)
    after_take = _draws()
    snap.restore(app)
    after_restore = _draws()
    out: dict[str, Any] = {"after_take": after_take, "same": after_take == after_restore}
    out["manifest"] = sorted(
        k for k in snap.get_manifest() if not k.split("/", 1)[1].startswith("rng")
    )
    out["read"] = snap.read_object(f"{rank}/local/n")
    # replicated= on async_take: the same tensor on both ranks, hashed and written half each
    same = StateDict(w=torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64))
    pending = Snapshot.async_take(path=f"{path}/rep", app_state={"s": same}, replicated=["s/**"])
    rep = pending.wait(60)
    out["rep_hashed"] = [r["hashed_bytes"] for r in rep.manifest.snapshot["ranks"]]
    # globs that differ between ranks: kept per rank (one entry, being equal), no error
    mixed = Snapshot.take(
        path=f"{path}/mixed", app_state={"s": same}, replicated=["s/**"] if rank == 0 else []
    )
    out["mixed"] = [
        mixed.get_manifest()["0/s/w"].kind,
        [r["hashed_bytes"] for r in mixed.manifest.snapshot["ranks"]],
    ]
    return out


def _global_w() -> torch.Tensor:
    return torch.arange(10 * 16, dtype=torch.float32).reshape(10, 16)


def rng_elastic_restore(
    rank: int, world: int, path: str, after_take: list[list[float]]
) -> dict[str, Any]:
    """3 ranks restore the 2-rank take: strict=False skips what rank 2 has none of, strict raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    captured = Captured()
    logging.getLogger("ckstore").addHandler(captured)
    torch.manual_seed(999)
    mesh = init_device_mesh("cpu", (world,))
    g = StateDict(w=distribute_tensor(torch.zeros(10, 16), mesh, [Shard(1)], src_data_rank=None))
    local = _local(rank, zeros=True)
    app = {"rng": CountingRNG(), "fx": DrawsRandomNumbers(), "g": g, "local": local}
    snap = Snapshot(path=f"{path}/elastic")
    try:
        snap.restore(app)
        strict_error = None
    except DistributedError as exc:
        strict_error = str(exc)
    untouched = (
        local["n"] == -1 and float(local["mine"].abs().sum()) == 0 and CountingRNG.loads == 0
    )
    snap.restore(app, strict=False)
    draws = _draws()
    from ckstore.format.boxes import local_box

    offs, sizes = local_box(g["w"])
    want = _global_w()[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
    return {
        "strict_error": strict_error,
        "untouched_after_strict": untouched,
        "dtensor_ok": bits(g["w"].to_local()) == bits(want),
        "local": [local["n"], float(local["mine"][0])],
        "rng_loads": CountingRNG.loads,
        "draws_match": draws == after_take[rank] if rank < len(after_take) else None,
        "warnings": captured.messages,
        "sd": sorted(snap.get_state_dict_for_key("local")),
        "sd_rank0": snap.get_state_dict_for_key("local", replicate_from_rank0=True)["n"],
    }
