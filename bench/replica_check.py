"""What comparing the ranks' replicas costs a distributed take (issue 34, item 1: at most 2%).

A data-parallel state (``--tensors`` float32 tensors, ``--mib`` in all, the same on every rank
and declared replicated, as a DDP module's parameters are) is taken on ``--ranks`` forked
ranks (gloo on CPU) into a local store, ``--rounds`` times with the replica check and as many
without it (the fingerprinting replaced by one that compares nothing), interleaved. Before
each take every element moves a little on every rank alike (training), so each take writes a
whole state. A take's time runs from a barrier before it to a barrier after it (the slowest
rank); the figures are the medians, with the CPU seconds of every rank's process together
(steadier than wall times on a shared machine), and the check's own seconds per rank (its
fingerprints, on threads of their own while the take hashes) beside them.

Beside them, the check's floor: every rank hashes its whole copy with XXH3 once, in 4 MiB
blocks on the store's threads, all ranks at once and nothing else running, timed from a
barrier to a barrier. To catch one flipped bit in any copy every rank must read all of its
copy, so no replica check can cost less than that; on a machine where ranks share cores the
floor is a share of a take that no code change removes.

    python bench/replica_check.py                        # 4 ranks, 64 MiB of 16 tensors, 5 rounds
    python bench/replica_check.py --mib 256 --rounds 3
    python bench/replica_check.py --dtensor              # the same as DTensors, [Replicate()]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from ckbench.ranks import on_ranks

import ckstore
from ckstore.distributed import _replicas
from ckstore.distributed import take as dist_take

BLOCK = 4 << 20


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
    store = ckstore.open(path, auto_compact=False)
    app = {"s": state(a.mib, a.tensors)}
    if a.dtensor:  # every rank holds every box: compared as shards of DTensors, not by the glob
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        app["s"] = ckstore.StateDict(
            {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in app["s"].items()}
        )
    checking = dist_take.fingerprints
    spent: list[float] = []

    def timed(*args: Any) -> _replicas.Fingerprints:
        t0 = time.perf_counter()
        try:
            return checking(*args)
        finally:
            spent.append(time.perf_counter() - t0)

    def skipped(*args: Any) -> _replicas.Fingerprints:
        return _replicas.Fingerprints()

    times: dict[str, list[float]] = {"check": [], "none": []}
    cpu: dict[str, list[float]] = {"check": [], "none": []}
    step = 0
    for i in range(a.rounds):
        for mode in ("check", "none") if i % 2 == 0 else ("none", "check"):
            for t in app["s"].values():
                t.mul_(1.0001)
            dist_take.fingerprints = timed if mode == "check" else skipped
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            snap = store.take(app, run="r", step=step, replicated=["s/*"], on_stale="ignore")
            cpu[mode].append(time.process_time() - c0)
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
            assert snap.record.diverged == (0 if mode == "check" else None)
            step += 1
    copies = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in app["s"].items()}
    floor, floor_cpu = _floor(copies, store.threads, a.rounds, dist.barrier)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {"times": times, "cpu": cpu, "check": spent, "floor": floor, "floor_cpu": floor_cpu}
        )
    )
    dist.barrier()
    store.close()


def _floor(
    tensors: dict[str, torch.Tensor], threads: int, rounds: int, barrier: Callable[[], Any]
) -> tuple[list[float], list[float]]:
    """Seconds (barrier to barrier) and this process's CPU seconds for every rank to XXH3 its
    whole copy at once, ``rounds`` times."""
    blocks = [
        memoryview(t.numpy()).cast("B")[i : i + BLOCK]
        for t in tensors.values()
        for i in range(0, t.numel() * t.element_size(), BLOCK)
    ]
    wall, cpu = [], []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in range(rounds):
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            list(pool.map(xxhash.xxh3_64_intdigest, blocks))
            cpu.append(time.process_time() - c0)
            barrier()
            wall.append(time.perf_counter() - t0)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state size in MiB (default 64)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors (default 16)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="takes of each kind (default 5)")
    ap.add_argument(
        "--dtensor",
        action="store_true",
        help="the tensors as DTensors replicated over every rank (compared as shards)",
    )
    a = ap.parse_args(argv)
    ranks = on_ranks(_rank, a.ranks, a, "ckstore-replica-check-")
    on = statistics.median(ranks[0]["times"]["check"])
    off = statistics.median(ranks[0]["times"]["none"])
    check = statistics.median(x for r in ranks for x in r["check"])
    floor = statistics.median(ranks[0]["floor"])
    floor_cpu = statistics.median(sum(c) for c in zip(*(r["floor_cpu"] for r in ranks)))
    cpu = {
        m: statistics.median(sum(c) for c in zip(*(r["cpu"][m] for r in ranks)))
        for m in ("check", "none")
    }
    print(
        f"{a.ranks} ranks, {a.mib} MiB replicated in {a.tensors} "
        f"{'DTensors' if a.dtensor else 'tensors'}, {a.rounds} takes each "
        f"(medians; {os.cpu_count()} cores)"
    )
    print(f"take with the replica check     {on:8.3f} s")
    print(f"take without it                 {off:8.3f} s")
    print(f"difference                      {100 * (on - off) / off:+7.1f} %")
    print(
        f"CPU of every rank, per take     {cpu['check']:8.3f} s with, {cpu['none']:.3f} s without "
        f"({100 * (cpu['check'] - cpu['none']) / cpu['none']:+.1f} %)"
    )
    print(f"fingerprinting one rank's copy  {check:8.3f} s  ({100 * check / on:.1f} % of a take)")
    print(
        f"the floor: every rank's copy    {floor:8.3f} s  ({100 * floor / off:.1f} % of a take "
        f"without the check), CPU of every rank {floor_cpu:.3f} s "
        f"({100 * floor_cpu / cpu['none']:.1f} %)"
    )
    print(f"the check's cost / its floor    {(on - off) / floor:8.2f}x (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
