"""What a distributed ``async_take`` blocks for, call after call (issue 36).

``--ranks`` forked ranks (gloo on CPU, torch on one thread each, as ranks sharing a host's
cores run) each hold a state of ``--mib`` MiB in ``--tensors`` float32 tensors, declared
replicated as a DDP module's are, and call ``async_take`` ``--calls`` times into a local
store, the state moving a little before each call (training) and every call waited for before
the next, as a loop that checkpoints every few steps does. Reported on rank 0: the first call
(its staging memory is new), the median of the others (they copy into the memory the one
before gave back), and one memcpy of the state into memory already touched: the unit the
blocking is held against (target: at most 1.2x from the second call).

    python bench/dist_async.py                         # 2 ranks, 768 MiB of 16 tensors, 6 calls
    python bench/dist_async.py --mib 128 --calls 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from ckbench.ranks import on_ranks

import ckstore


def _rank(rank: int, world: int, port: int, path: str, a: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = ckstore.open(path, auto_compact=False)
    gen = torch.Generator().manual_seed(0)
    n = (a.mib << 18) // a.tensors  # float32 elements per tensor
    state = {f"w{i}": torch.randn(n, generator=gen).reshape(-1, 256) for i in range(a.tensors)}
    app = {"s": ckstore.StateDict(state)}
    copies = [t.clone() for t in state.values()]
    blocked: list[float] = []
    memcpy: list[float] = []
    for step in range(a.calls):
        for t in state.values():
            t.mul_(1.0001)
        t0 = time.perf_counter()
        for c, t in zip(copies, state.values()):
            c.copy_(t)
        memcpy.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        pending = store.async_take(app, run="r", step=step, replicated=["s/*"], on_stale="ignore")
        blocked.append(time.perf_counter() - t0)
        pending.wait(600)
    store.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"blocked": blocked, "memcpy": memcpy}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=768, help="state per rank in MiB (default 768)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors per rank (default 16)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--calls", type=int, default=6, help="async_take calls (default 6)")
    a = ap.parse_args(argv)
    if a.calls < 2:
        ap.error("--calls must be at least 2: the first call and the ones after it")
    rank0 = on_ranks(_rank, a.ranks, a, "ckstore-dist-async-")[0]
    first = rank0["blocked"][0]
    again = statistics.median(rank0["blocked"][1:])
    memcpy = statistics.median(rank0["memcpy"])
    print(
        f"{a.ranks} ranks, {a.mib} MiB per rank in {a.tensors} tensors, {a.calls} calls "
        f"(rank 0; {os.cpu_count()} cores)"
    )
    print(f"first async_take blocks          {1e3 * first:9.1f} ms")
    print(f"the next ones block (median)     {1e3 * again:9.1f} ms")
    print(f"one memcpy of the state          {1e3 * memcpy:9.1f} ms")
    print(f"from the second call / memcpy    {again / memcpy:9.2f}x  (target 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
