"""cProfile of one ckstore take in every thread (written to ``profile_take.txt``), and the
single-thread throughput of each take stage (hash, encode, write+fsync, memcpy)."""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..harness import Bench
from ..states import iter_tensors
from ..util import MiB, fmt_b, scrub_paths


def profile(b: Bench) -> None:
    if not b.ok("ckstore") or b.args.no_profile:
        return
    b.log("profiling one ckstore take (all threads)")
    root = b.fresh("profile")
    stats, threads_seen, wall = profiled_take(b, root)
    buf = io.StringIO()
    stats.stream = buf  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    b.extra["profile"] = {
        "wall_seconds": wall,
        "threads_profiled": threads_seen,
        "top_tottime": top_tottime(stats),
    }
    b.extra["stage_rates"] = stage_rates(b)
    (b.out / "profile_take.txt").write_text(
        f"one ckstore take of {fmt_b(b.state_bytes)}: {wall:.2f} s wall, {threads_seen} threads profiled\n"
        "(tottime summed over threads; idle waits show up as lock/acquire time)\n\n"
        + scrub_paths(buf.getvalue())
    )
    shutil.rmtree(root, ignore_errors=True)


def profiled_take(b: Bench, root: Path) -> tuple[pstats.Stats, int, float]:
    """One take into a fresh store under a profiler in every thread: merged stats, the number
    of threads profiled, wall seconds."""
    ck = b.ckstore()
    store = ck.ck.open(root / "store", create=True)
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start(frame: Any, event: str, arg: Any) -> None:
        p = cProfile.Profile()
        with lock:
            profiles.append(p)
        p.enable()

    main = cProfile.Profile()
    threading.setprofile(start)
    gc.collect()
    t0 = time.perf_counter()
    main.enable()
    try:
        store.take(ck.app(b.state), run="profile", step=0)
    finally:
        main.disable()
        threading.setprofile(None)
        wall = time.perf_counter() - t0
        store.close()
    stats = pstats.Stats(main)
    for p in profiles:
        try:
            stats.add(p)
        except Exception:  # noqa: BLE001 - a profiler of a live thread may refuse
            pass
    return stats, 1 + len(profiles), wall


def top_tottime(stats: pstats.Stats) -> list[dict[str, Any]]:
    top = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in sorted(
        stats.stats.items(), key=lambda kv: -kv[1][2]
    )[:15]:  # type: ignore[attr-defined]
        top.append(
            {
                "function": f"{Path(file).name}:{line}({fn})",
                "calls": nc,
                "tottime": tt,
                "cumtime": ct,
            }
        )
    return top


def sample_views(state: Any, budget: int = 256 * MiB) -> list[memoryview]:
    """4 MiB views of the state's tensors of 1 MiB or more, up to about ``budget`` bytes."""
    views = []
    for _, t in iter_tensors(state):
        if t.numel() * 4 < 1 * MiB:
            continue
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        for off in range(0, len(raw), 4 * MiB):
            views.append(raw.data[off : off + 4 * MiB])
            budget -= len(views[-1])
            if budget <= 0:
                break
        if budget <= 0:
            break
    return views


def stage_rates(b: Bench) -> dict[str, Any]:
    """Single-thread throughput of each take stage on up to 256 MiB of the state's bytes."""
    from ckstore import objects

    views = sample_views(b.state)
    n = sum(len(v) for v in views)
    rates: dict[str, Any] = {"bytes": n}
    t0 = time.perf_counter()
    for v in views:
        objects.chunk_id(v)
    rates["blake3_GBps"] = n / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    enc = 0
    for v in views:
        enc += len(objects.encode(v, 4, True)[1])
    rates["encode_GBps"] = n / (time.perf_counter() - t0) / 1e9
    rates["encoded_fraction"] = enc / n
    rates["write_fsync_GBps"] = n / write_fsync_seconds(b.work / "fsync_probe.bin", views) / 1e9
    t0 = time.perf_counter()
    for v in views:
        bytearray(v)
    rates["memcpy_GBps"] = n / (time.perf_counter() - t0) / 1e9
    return rates


def write_fsync_seconds(path: Path, views: list[memoryview]) -> float:
    """Seconds to write ``views`` to a new file and fsync it (the file is removed after)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for v in views:
            f.write(v)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt
