"""The first save from N writer processes: a gloo job of N ranks (spawned, the machine's cores
shared out as intra-op threads, at least one each) in which every rank holds 1/N of every tensor of the state (a DTensor ``Shard(0)`` over a
1-D CPU mesh; the 0-dim Adam steps stay plain tensors) and saves it into a fresh prefix.

ckstore: ``store.take`` under torch.distributed into one store (SQLite index in a local temp
folder, shared by the ranks of this one host). DCP: ``dcp.save`` with an ``FsspecWriter`` per
rank. The time is rank 0's, from a barrier before the save to a barrier after it (so the slowest
rank's); starting the processes and building the state are not timed. Every wait has a
deadline: a job that does not finish in ``timeout`` seconds is killed and reported as failed.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from ..states import build_state
from .server import ObjectStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sharded_state(size: int, seed: int, world: int) -> dict[str, Any]:
    """:func:`build_state` with every tensor of rank >= 1 cut into ``world`` row shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def shard(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return distribute_tensor(x, mesh, [Shard(0)], src_data_rank=None)
        if isinstance(x, dict):
            return {k: shard(v) for k, v in x.items()}
        return x

    return shard(build_state(size, seed))  # type: ignore[no-any-return]


def _rank(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=job["timeout"])
        )
        state = sharded_state(job["size"], job["seed"], world)
        save = _saver(job, state)
        dist.barrier()
        t0 = time.perf_counter()
        save()
        dist.barrier()
        result = {"ok": True, "seconds": time.perf_counter() - t0}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown collectives: a failed peer may never reach them


def _saver(job: dict[str, Any], state: dict[str, Any]) -> Any:
    if job["system"] == "ckstore":
        import ckstore

        store = ckstore.open(job["url"], index=job["index"], storage_options=job["opts"])
        app = {k: ckstore.StateDict(v) for k, v in state.items()}
        return lambda: store.take(app, run="scale", step=0)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    def save() -> None:
        dcp.save(
            state,
            storage_writer=FsspecWriter(job["url"], thread_count=job["threads"], **job["opts"]),
        )

    return save


def first_save(
    obj: ObjectStore,
    system: str,
    world: int,
    size: int,
    seed: int,
    threads: int,
    timeout: float,
    prefix: str,
) -> dict[str, Any]:
    """One N-rank first save of ``system`` below ``prefix``: ``{"seconds": ...}`` or
    ``{"error": ...}``, plus the bytes stored."""
    with tempfile.TemporaryDirectory(prefix="ckbench-scale-") as tmp:
        job: dict[str, Any] = {
            "system": system,
            "size": size,
            "seed": seed,
            "threads": threads,
            "timeout": timeout,
            "out": tmp,
            "opts": obj.storage_options(),
        }
        if system == "ckstore":
            import ckstore

            job["url"] = obj.url(f"{prefix}/store")
            job["index"] = f"sqlite:///{Path(tmp) / 'index.db'}"
            ckstore.open(
                job["url"], index=job["index"], storage_options=job["opts"], create=True
            ).close()
        else:
            job["url"] = obj.url(f"{prefix}/ckpt")
        ctx = mp.start_processes(
            _rank, args=(world, _free_port(), job), nprocs=world, start_method="spawn", join=False
        )
        deadline = time.monotonic() + timeout
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        killed = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
        reports = [Path(tmp, f"rank{r}.json") for r in range(world)]
        results = [json.loads(f.read_text()) if f.exists() else None for f in reports]
    bad = [(r, x) for r, x in enumerate(results) if not x or not x["ok"]]
    if killed or bad:
        why = "; ".join(f"rank {r}: {x['error'] if x else 'no report'}" for r, x in bad)
        return {
            "error": (f"killed after {timeout:.0f} s (ranks {killed}); " if killed else "") + why
        }
    return {"seconds": results[0]["seconds"], "stored_bytes": obj.stored_bytes(prefix)}
