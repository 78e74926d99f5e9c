"""One "host" of the many-writers test (run as ``python -m tests.support.host_worker MODE ...`` in its own cwd, the repository root on ``PYTHONPATH``).

``take URL INDEX OPTS RUN STEPS``: takes one snapshot per step into RUN (content a function of
run and step, see :func:`state_for`), restores each one right after into a zeroed state and
compares the bits; prints one JSON line per committed snapshot and per failure.
``gc URL INDEX OPTS SECONDS``: runs retention (keep the last 3 of each run, 1 s grace) in a
loop until a file ``stop`` appears in its cwd (at most SECONDS); prints one JSON line per run
with the snapshots it dropped (``run@step``).
``dist URL INDEX OPTS RUN STEPS WORLD``: a torch.distributed job on this host, WORLD forked
ranks (gloo on loopback, a free port), each holding 1/WORLD of every tensor of
:func:`state_for` as a DTensor ``Shard(0)``; all ranks take one snapshot per step together,
restore it into zeroed DTensors and agree that every shard came back bit-exactly. Rank 0 prints
the same JSON lines as ``take``. The job ends within :data:`DIST_TIMEOUT_S` or is killed and
exits non-zero; every collective (gloo and ckstore's own) has a timeout below that.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import zlib
from datetime import timedelta
from typing import Any

import torch

import ckstore

DIST_TIMEOUT_S = 70.0  # the whole job
COLLECTIVE_TIMEOUT_S = 30  # one gloo collective (init included) or ckstore collective


def state_for(run: str, step: int) -> dict[str, torch.Tensor]:
    """A shared base (dedups across hosts), a part that changes every 3 steps, a fresh part."""
    seed = zlib.crc32(run.encode())
    return {
        "base": torch.randn(96, 32, generator=torch.Generator().manual_seed(7)),
        "slow": torch.randn(64, 32, generator=torch.Generator().manual_seed(seed + step // 3)),
        "fresh": torch.randn(
            48, 32, generator=torch.Generator().manual_seed(seed * 1000 + step)
        ).to(torch.bfloat16),
    }


def open_store(url: str, index: str, opts: str) -> ckstore.Store:
    return ckstore.open(
        url,
        index=index,
        storage_options=json.loads(opts),
        chunk_bytes=1024,
        pack_bytes=8192,
        create=True,
    )


def take(url: str, index: str, opts: str, run: str, steps: str) -> None:
    store = open_store(url, index, opts)
    for step in (int(s) for s in steps.split(",")):
        try:
            snap = store.take({"s": ckstore.StateDict(state_for(run, step))}, run=run, step=step)
            zero = {k: torch.zeros_like(v) for k, v in state_for(run, step).items()}
            target = ckstore.StateDict(zero)
            snap.restore({"s": target})
            exact = all(torch.equal(target[k], v) for k, v in state_for(run, step).items())
            print(
                json.dumps(
                    {"committed": snap.id, "run": run, "step": step, "restored_exact": exact}
                ),
                flush=True,
            )
        except ckstore.CkstoreError as exc:  # reported, never silent; the test counts them
            print(
                json.dumps({"failed": step, "run": run, "error": f"{type(exc).__name__}: {exc}"}),
                flush=True,
            )
    store.close()


def gc(url: str, index: str, opts: str, seconds: str) -> None:
    store = open_store(url, index, opts)
    deadline = time.time() + float(seconds)
    while time.time() < deadline and not os.path.exists("stop"):
        report = store.gc(keep_last=3, grace_seconds=1.0)
        print(
            json.dumps(
                {"dropped": report.snapshots_dropped, "packs_removed": report.packs_removed}
            ),
            flush=True,
        )
        time.sleep(0.3)
    store.close()


def _sharded(state: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in state.items()}


def _rank(
    rank: int, world: int, port: int, url: str, index: str, opts: str, run: str, steps: str
) -> None:
    try:
        _rank_steps(rank, world, port, url, index, opts, run, steps)
    except BaseException:  # the traceback goes to this host's stderr, which the test shows
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no teardown collectives: they could wait on a rank that failed


def _rank_steps(
    rank: int, world: int, port: int, url: str, index: str, opts: str, run: str, steps: str
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # forked: never enter the parent's intra-op pool
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CKSTORE_DIST_TIMEOUT=str(COLLECTIVE_TIMEOUT_S),
    )
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    mesh = init_device_mesh("cpu", (world,))
    store = open_store(url, index, opts)
    for step in (int(s) for s in steps.split(",")):
        try:
            snap = store.take(
                {"s": ckstore.StateDict(_sharded(state_for(run, step), mesh))}, run=run, step=step
            )
            zero = ckstore.StateDict(
                _sharded({k: torch.zeros_like(v) for k, v in state_for(run, step).items()}, mesh)
            )
            snap.restore({"s": zero})
            mine = all(
                torch.equal(zero[k].to_local(), v.to_local())
                for k, v in _sharded(state_for(run, step), mesh).items()
            )
            flag = torch.tensor([int(mine)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if rank == 0:
                print(
                    json.dumps(
                        {
                            "committed": snap.id,
                            "run": run,
                            "step": step,
                            "restored_exact": bool(flag.item()),
                            "world": world,
                        }
                    ),
                    flush=True,
                )
        except ckstore.CkstoreError as exc:  # reported, never silent; the test counts them
            print(
                json.dumps(
                    {
                        "failed": step,
                        "run": run,
                        "rank": rank,
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                ),
                flush=True,
            )
    store.close()


def _preimport() -> None:
    """Import here, once, what every rank needs (DTensor and the ``torch._dynamo`` that
    ``distribute_tensor`` imports on first use, s3fs, SQLAlchemy with its PostgreSQL dialect,
    ckstore's distributed take and restore): the forked ranks inherit the modules instead of
    spending about 3 s of CPU each importing them. Nothing is opened before the fork."""
    import importlib

    for name in (
        "torch.distributed.tensor",
        "torch.distributed.device_mesh",
        "torch._dynamo",
        "s3fs",
        "sqlalchemy",
        "sqlalchemy.dialects.postgresql.psycopg",
        "psycopg",
        "ckstore.distributed.take",
        "ckstore.distributed.take_async",
        "ckstore.distributed.restore",
    ):
        importlib.import_module(name)


def dist_job(url: str, index: str, opts: str, run: str, steps: str, world: str) -> None:
    import torch.multiprocessing as mp

    _preimport()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    n = int(world)
    ctx = mp.start_processes(
        _rank,
        args=(n, port, url, index, opts, run, steps),
        nprocs=n,
        start_method="fork",
        join=False,
    )
    deadline = time.monotonic() + DIST_TIMEOUT_S
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in ctx.processes]
    if hung:
        sys.exit(
            f"dist job: ranks {hung} still running after {DIST_TIMEOUT_S} s, killed; exit codes {codes}"
        )
    if any(c != 0 for c in codes):
        sys.exit(f"dist job: rank exit codes {codes}")


if __name__ == "__main__":
    {"take": take, "gc": gc, "dist": dist_job}[sys.argv[1]](*sys.argv[2:])
