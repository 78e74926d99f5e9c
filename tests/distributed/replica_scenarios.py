"""Replicas that disagree, on real ranks: a DDP job (and a tensor a ``replicated=`` glob names)
whose copies are bit-flipped on one rank, and a DDP job saving deterministically; run by
``test_replicas_dist.py``."""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

import ckstore
from ckstore.errors import DistributedError
from tests.distributed.scenarios import TINY

FLIPS = 50
SAVES = 50
SEED = 3434


def _ddp_job(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    """A DDP model (two linear layers and a batch norm, the same initial weights on every rank)
    and its Adam optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    inner = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.BatchNorm1d(40), torch.nn.ReLU(), torch.nn.Linear(40, 8)
    )
    ddp = DistributedDataParallel(inner)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)


def _step(ddp: Any, opt: torch.optim.Optimizer, rank: int, n: int) -> None:
    """One training step on this rank's own batch (so the batch norm's running statistics
    differ between ranks, as in any DDP job); DDP averages the gradients."""
    gen = torch.Generator().manual_seed(1000 * n + rank)
    ddp(torch.randn(16, 24, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        ints = t.view(-1).view(torch.int32)
        ints[index] ^= 1 << bit


def flips(rank: int, world: int, path: str) -> dict[str, Any]:
    """FLIPS takes, each after one bit of one rank's copy of one replicated tensor (a DDP
    parameter, or the glob-declared ``extra/table``) was flipped; the same choice on every rank
    (a shared seed). Then a take refused with ``on_divergence="raise"``."""
    store = ckstore.open(path, **TINY, create=True)
    ddp, opt = _ddp_job(7)
    _step(ddp, opt, rank, 0)
    extra = ckstore.StateDict(table=torch.arange(600, dtype=torch.float32).reshape(30, 20))
    tensors = {f"ddp/{k}": v for k, v in ddp.state_dict().items() if v.dtype == torch.float32}
    tensors = {k: v for k, v in tensors.items() if "running" not in k}  # parameters
    tensors["extra/table"] = extra["table"]
    rng = random.Random(SEED)
    found: list[Any] = []
    caught: list[str] = []
    for n in range(FLIPS):
        key = rng.choice(sorted(tensors))
        who, bit = rng.randrange(world), rng.randrange(32)
        t = tensors[key]
        index = rng.randrange(t.numel())
        if rank == who:
            _flip_bit(t, index, bit)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            snap = store.take(
                {"ddp": ddp, "optim": opt, "extra": extra},
                run="flips",
                step=n,
                replicated=["extra/*"],
                on_stale="ignore",  # nothing trains between these takes
            )
        caught += [str(w.message) for w in got if isinstance(w.message, ckstore.GuardWarning)]
        if rank == who:
            _flip_bit(t, index, bit)  # put it back
        where = list(divmod(index, t.shape[1])) if t.dim() == 2 else [index]
        health = snap.health if rank == 0 else None
        found.append(
            {
                "key": key,
                "rank": who,
                "where": where,
                "diverged": snap.record.diverged,
                "healthy": snap.healthy,
                "recorded": {
                    k: {
                        "ranks": list(d.ranks),
                        "regions": [[list(o), list(s)] for o, s in d.regions],
                    }
                    for k, d in (health.diverged if health else {}).items()
                },
                "checked": health.replicas.checked if health and health.replicas else None,
            }
        )
    if rank == 1:
        _flip_bit(tensors["ddp/module.0.weight"], 5, 30)
    refused = None
    try:
        store.take(
            {"ddp": ddp, "optim": opt},
            run="flips",
            step=FLIPS,
            on_divergence="raise",
            on_stale="ignore",
        )
    except DistributedError as exc:
        refused = {"message": str(exc), "causes": {str(k): v for k, v in exc.causes.items()}}
    return {
        "found": found,
        "warnings": caught,
        "refused": refused,
        "steps": [s.step for s in store.log("flips")],
        "healthy": store.log("flips", healthy=True) == [],
    }


def saves(rank: int, world: int, path: str) -> dict[str, Any]:
    """SAVES takes of a DDP job training deterministically (each rank its own batches, so its
    batch norm statistics are its own), with per-rank RNG states beside: no alarm."""
    store = ckstore.open(path, **TINY, create=True)
    ddp, opt = _ddp_job(8)
    diverged = []
    caught: list[str] = []
    for n in range(SAVES):
        _step(ddp, opt, rank, n)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            snap = store.take(
                {"ddp": ddp, "optim": opt, "rng": ckstore.RNGState()}, run="saves", step=n
            )
        caught += [str(w.message) for w in got if isinstance(w.message, ckstore.GuardWarning)]
        diverged.append(snap.record.diverged)
    return {
        "diverged": diverged,
        "warnings": caught,
        "healthy": [s.step for s in store.log("saves", healthy=True)],
    }


SHARD_FLIPS = 24


def shard_flips(rank: int, world: int, path: str) -> dict[str, Any]:
    """DTensor shards that several ranks hold (on 4 ranks): ``hsdp/w`` on a (2, 2) mesh with
    ``[Replicate(), Shard(0)]`` (ranks 0 and 2 hold rows 0-19, ranks 1 and 3 rows 20-39, as
    HSDP keeps them) and ``rep/w`` on a (4,) mesh with ``[Replicate()]`` (every rank holds it
    all). A take of the untouched state first; then SHARD_FLIPS takes, each after one bit of
    one rank's shard was flipped (the same choice on every rank; in ``hsdp/w`` only on ranks 2
    and 3: of two copies the lower rank's is taken for right); then a take with the shards of
    ranks 2 and 3 swapped (each holds the bytes of the other's box: their groups' differences
    must not cancel out); then one flip on rank 0's ``hsdp/w`` shard (that tie), and a take
    refused with ``on_divergence="raise"``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = ckstore.open(path, **TINY, create=True)
    gen = torch.Generator().manual_seed(11)
    hsdp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    flat_mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(40, 24, generator=gen)
    app = ckstore.StateDict(
        hsdp=distribute_tensor(full, hsdp_mesh, [Replicate(), Shard(0)]),
        rep=distribute_tensor(torch.randn(30, 20, generator=gen), flat_mesh, [Replicate()]),
    )
    local = {k: app[k].to_local() for k in ("hsdp", "rep")}
    rows = {"hsdp": 20 * (rank % 2), "rep": 0}  # where this rank's shard starts
    rng = random.Random(SEED + 1)

    def take(step: int, **kw: Any) -> dict[str, Any]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            snap = store.take({"m": app}, run="shards", step=step, on_stale="ignore", **kw)
        health = snap.health if rank == 0 else None
        return {
            "diverged": snap.record.diverged,
            "healthy": snap.healthy,
            "warned": [str(w.message) for w in got if isinstance(w.message, ckstore.GuardWarning)],
            "recorded": {
                k: {"ranks": list(d.ranks), "regions": [[list(o), list(s)] for o, s in d.regions]}
                for k, d in (health.diverged if health else {}).items()
            },
            "checked": health.replicas.checked if health and health.replicas else None,
        }

    clean = take(0)
    found = []
    for n in range(1, SHARD_FLIPS + 1):
        key = ("hsdp", "rep")[n % 2]
        who = rng.choice((2, 3)) if key == "hsdp" else rng.randrange(world)
        t = local[key]
        index, bit = rng.randrange(t.numel()), rng.randrange(32)
        row, col = divmod(index, t.shape[1])
        if rank == who:
            _flip_bit(t, index, bit)
        got = take(n)
        if rank == who:
            _flip_bit(t, index, bit)  # put it back
        who_rows = 20 * (who % 2) if key == "hsdp" else 0
        found.append({**got, "key": f"m/{key}", "rank": who, "where": [row + who_rows, col]})
    if rank in (2, 3):  # rank 2 holds rows 0-19 and gets 20-39; rank 3 the other way
        local["hsdp"].copy_(full[20:] if rank == 2 else full[:20])
    swapped = take(SHARD_FLIPS + 1)
    local["hsdp"].copy_(full[20 * (rank % 2) : 20 * (rank % 2) + 20])
    if rank == 0:
        _flip_bit(local["hsdp"], 3, 7)
    tie = take(SHARD_FLIPS + 2)
    refused = None
    try:
        take(SHARD_FLIPS + 3, on_divergence="raise")
    except DistributedError as exc:
        refused = {"causes": {str(k): v for k, v in exc.causes.items()}}
    return {
        "clean": clean,
        "found": found,
        "swapped": swapped,
        "tie": tie,
        "refused": refused,
        "rows": rows[("hsdp")],
        "steps": [s.step for s in store.log("shards")],
    }
