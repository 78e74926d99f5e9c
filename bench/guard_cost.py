"""What the take's guard costs: take time with health measured and without, side by side.

The state is the benchmark's (``ckbench.states``: a transformer-shaped fp32 model and its Adam
moments). Each round, in an order that alternates, takes it with ``health=True`` and with
``health=False``, each into a store of its own: a first take (every chunk new), then an
incremental one after a training step on a trained head (``trainable``: a fraction of the
state, params and moments), whose stale check compares against the first. Besides the
medians of the wall times, the guard's own work is timed where it runs: the CPU seconds the
workers spend in ``chunk_stats`` (beside hashing, on the same threads) and the wall time of
the stale check (``TakeGuard._stale``: one index query, the parent manifest, a comparison).
On a shared machine wall times swing by tens of percent between identical takes: the CPU
time of the whole process per take (``time.process_time``, all threads) is printed beside it,
and the guard's own CPU share is the steadiest figure.

    python bench/guard_cost.py                          # 270 MiB and 2 GiB, 3 rounds
    python bench/guard_cost.py --size-mb 270 --rounds 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckbench.states import build_state, choose_trainable, mutate, state_bytes  # noqa: E402

import ckstore  # noqa: E402
from ckstore.engine.take import guard as guard_module  # noqa: E402


class _Clock:
    """Seconds spent inside the wrapped functions (summed over threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = 0.0
        self.stale = 0.0

    def wrap(self) -> None:
        stats, stale, parent = (
            guard_module.chunk_stats,
            guard_module.TakeGuard._stale,
            guard_module.TakeGuard.parent,
        )

        def timed_stats(*a: Any) -> Any:
            t0 = time.thread_time()
            try:
                return stats(*a)
            finally:
                with self.lock:
                    self.stats += time.thread_time() - t0

        def timed_stale(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return stale(*a)
            finally:
                self.stale += time.perf_counter() - t0

        def timed_parent(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return parent(*a)
            finally:
                self.stale += time.perf_counter() - t0

        guard_module.chunk_stats = timed_stats  # type: ignore[assignment]
        guard_module.TakeGuard._stale = timed_stale  # type: ignore[method-assign]
        guard_module.TakeGuard.parent = timed_parent  # type: ignore[method-assign]

    def reset(self) -> None:
        self.stats = self.stale = 0.0


def _app(state: dict[str, Any]) -> dict[str, Any]:
    return {k: ckstore.StateDict(v) for k, v in state.items()}


def one_round(
    state: dict[str, Any], keys: list[str], health: bool, tmp: Path, clock: _Clock, seed: int
) -> dict[str, float]:
    path = tmp / f"store-{health}-{seed}"
    out: dict[str, float] = {}
    with ckstore.open(path, create=True) as store:
        for kind, step in (("first", 1), ("incremental", 2)):
            if kind == "incremental":
                mutate(state, keys, seed)
            clock.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            store.take(_app(state), run="r", step=step, health=health)
            out[kind] = time.perf_counter() - t0
            out[f"{kind}_cpu"] = time.process_time() - c0
            out[f"{kind}_stats_cpu"] = clock.stats
            out[f"{kind}_stale"] = clock.stale
    shutil.rmtree(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, nargs="+", default=[270, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--trainable", type=float, default=0.1, help="fraction of the state a step changes"
    )
    args = ap.parse_args()
    clock = _Clock()
    clock.wrap()
    print(
        f"threads={ckstore.open(tempfile.mkdtemp(), create=True).threads} (a shared machine: medians of {args.rounds} rounds)"
    )
    for mb in args.size_mb:
        state = build_state(mb << 20, seed=0)
        keys = choose_trainable(state, args.trainable)
        rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        with tempfile.TemporaryDirectory(prefix="ckstore-guard-bench-") as d:
            for r in range(args.rounds):
                for health in (True, False) if r % 2 == 0 else (False, True):
                    rows[health].append(one_round(state, keys, health, Path(d), clock, seed=r))
        size = state_bytes(state) / 2**20
        for kind in ("first", "incremental"):
            med = {
                h: {f: statistics.median(x[f] for x in rows[h]) for f in (kind, f"{kind}_cpu")}
                for h in rows
            }
            on, off = med[True][kind], med[False][kind]
            con, coff = med[True][f"{kind}_cpu"], med[False][f"{kind}_cpu"]
            stats = statistics.median(x[f"{kind}_stats_cpu"] for x in rows[True])
            stale = statistics.median(x[f"{kind}_stale"] for x in rows[True])
            print(
                f"{size:6.0f} MiB {kind:<11} wall: on {on:6.2f} s off {off:6.2f} s ({100 * (on - off) / off:+5.1f}%)  "
                f"CPU: on {con:6.2f} s off {coff:6.2f} s ({100 * (con - coff) / coff:+5.1f}%)  |  "
                f"chunk_stats {stats:5.3f} CPU s = {100 * stats / con:4.1f}% of the take's CPU  "
                f"stale check {1000 * stale:6.1f} ms = {100 * stale / on:4.2f}% of its wall time"
            )


if __name__ == "__main__":
    main()
