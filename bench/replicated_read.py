"""A state every rank holds, restored on N ranks: bytes read from storage and time, per mode.

A data-parallel state (``--tensors`` float32 tensors, ``--mib`` in all, the same on every rank
and NOT declared replicated) is taken once, then restored on ``--ranks`` forked ranks (gloo on
CPU) in each mode, interleaved, ``--rounds`` times:

* ``each``: every rank reads everything it needs itself (``replicated_read="each"``);
* ``once``: each chunk read by one rank and sent (the default), ``atomic=False``;
* ``once atomic``: the same, atomic, default memory budget (streamed: verified, then read
  again to be sent);
* ``once atomic held``: atomic with a budget the whole exchange fits in (held: read once).

Bytes are counted at the storage boundary (``objects.CountingBackend``: pack bytes the backend
returned) and reported as a multiple of the state's distinct stored bytes, with the spread of
the per-rank figures around their mean. The time of one restore is from a barrier before it
to a barrier after it (the slowest rank); medians are printed. Local store, warm page cache.

    python bench/replicated_read.py                     # 4 ranks, 16 MiB of 64 tensors, 3 rounds
    python bench/replicated_read.py --mib 256 --ranks 2
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
from typing import Any

import torch
import torch.multiprocessing as mp

import ckstore
from ckstore import objects

MODES: dict[str, dict[str, Any]] = {
    "each": {"replicated_read": "each"},
    "once": {"atomic": False},
    "once atomic": {},
    "once atomic held": {"memory_budget": 1 << 40},
}


def state(mib: int, tensors: int) -> ckstore.StateDict:
    gen = torch.Generator().manual_seed(0)
    n = (mib << 18) // tensors  # float32 elements per tensor
    return ckstore.StateDict(
        {f"w{i}": torch.randn(n, generator=gen).reshape(-1, 256) for i in range(tensors)}
    )


def _rank(rank: int, world: int, port: int, path: str, a: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    want = state(a.mib, a.tensors)
    dest = ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})
    store = ckstore.open(path)
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    snap = store.get("rep")
    _ = snap.manifest
    times: dict[str, list[float]] = {m: [] for m in MODES}
    read: dict[str, int] = {}
    for i in range(a.rounds):
        for mode in MODES if i % 2 == 0 else list(MODES)[::-1]:
            for t in dest.values():
                t.zero_()
            counting.reset()
            dist.barrier()
            t0 = time.perf_counter()
            snap.restore({"s": dest}, **MODES[mode])
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
            read[mode] = sum(g.nbytes for g in counting.gets if g.name.startswith("packs/"))
            assert all(torch.equal(dest[k], want[k]) for k in want), mode
    Path(out, f"{rank}.json").write_text(json.dumps({"times": times, "read": read}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=16, help="state size (MiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to put the store (default: a temp dir)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = str(Path(tmp, "store"))
        with ckstore.open(path, create=True) as store:
            snap = store.take({"s": state(a.mib, a.tensors)}, run="rep")
            ids = snap.manifest.chunk_ids()
            stored = sum(c.length for c in store.repository.index.all_chunks() if c.chunk_id in ids)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        mp.start_processes(
            _rank, args=(a.ranks, port, path, a, tmp), nprocs=a.ranks, start_method="fork"
        )
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(a.ranks)]
    print(
        f"restore of {a.mib} MiB ({a.tensors} tensors, {stored / 2**20:.1f} MiB stored) held by every rank, "
        f"undeclared, on {a.ranks} ranks ({os.cpu_count()} CPUs), {a.rounds} rounds:"
    )
    print("| mode | read / stored | per-rank spread | median s | all s |")
    print("|---|---:|---:|---:|---|")
    for mode in MODES:
        per = [r["read"][mode] for r in ranks]
        mean = sum(per) / len(per)
        spread = max(abs(x - mean) for x in per) / mean if mean else 0.0
        worst = [max(r["times"][mode][i] for r in ranks) for i in range(a.rounds)]
        print(
            f"| {mode} | {sum(per) / stored:.3f}x | {100 * spread:.1f}% | {statistics.median(worst):.3f} | "
            f"{[round(t, 3) for t in worst]} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
