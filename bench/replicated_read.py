"""Replicated entries in a distributed restore: every rank reads them, or rank 0 broadcasts.

A DDP-style state (plain tensors, the same on every rank) is taken once, then restored on
``--ranks`` forked ranks (gloo on CPU) with ``replicated_read="each"`` and ``"broadcast"``,
interleaved, ``--rounds`` times each. The time of one restore is from a barrier before it to a
barrier after it (the slowest rank); the medians are printed. Local store, warm page cache.

    python bench/replicated_read.py                    # 4 ranks, 200 MiB, 3 rounds
    python bench/replicated_read.py --mib 512 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

import ckstore

TENSOR_MIB = 4
MODES = ("each", "broadcast")


def state(mib: int) -> ckstore.StateDict:
    gen = torch.Generator().manual_seed(0)
    n = TENSOR_MIB << 18  # float32 elements per tensor
    return ckstore.StateDict({f"w{i}": torch.randn(n, generator=gen).reshape(-1, 1024) for i in range(mib // TENSOR_MIB)})


def _rank(rank: int, world: int, port: int, path: str, mib: int, rounds: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    want = state(mib)
    dest = ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})
    snap = ckstore.open(path).get("rep")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            for t in dest.values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            snap.restore({"s": dest}, replicated_read=mode)
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
            assert all(torch.equal(dest[k], want[k]) for k in want), mode
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=200, help="replicated state size (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to put the store (default: a temp dir)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = str(Path(tmp, "store"))
        with ckstore.open(path, create=True) as store:
            store.take({"s": state(a.mib)}, run="rep")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        out = str(Path(tmp, "times.json"))
        mp.start_processes(_rank, args=(a.ranks, port, path, a.mib, a.rounds, out), nprocs=a.ranks, start_method="fork")
        times = json.loads(Path(out).read_text())
    print(f"restore of {a.mib} MiB replicated on {a.ranks} ranks ({os.cpu_count()} CPUs), {a.rounds} rounds, seconds:")
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"  {mode:<9} median {med:6.3f}  ({a.mib / med:7.1f} MiB/s per rank)  all {[round(t, 3) for t in times[mode]]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
