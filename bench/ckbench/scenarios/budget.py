"""The staging budget: the memory an ``async_take`` adds, and what it blocks for, at budgets of
0.25x, 0.5x and 1x the state, each in a child process (this module holds both sides).

The child reads the state, opens a store, and takes it twice with ``async_take`` under the
budget (each waited for), an RSS sampler thread reading ``/proc/self/statm`` every
millisecond meanwhile (and ``VmHWM``, reset first, where the kernel allows it). Reported per
budget: the peak RSS above the live state (before the first take) against the budget plus
the largest chunk (issue "Training does not feel it": at most that), and each take's blocking
beside what the first take's ``BlockingReport.predict`` said the second would block for.

Results: ``b.extra["budget"]``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..harness import Bench
from ..states import read_state_file, write_state_file
from ..util import BENCH_DIR, fmt_b, fmt_s, proc_status, reset_peak_rss

ENTRY = BENCH_DIR / "run.py"
RESULT_PREFIX = "RESULT "
FRACTIONS = (0.25, 0.5, 1.0)


# ---------------------------------------------------------------------------------------------
# parent


def budget(b: Bench) -> None:
    b.log("staging budget: async_take's peak RSS and blocking, each budget in a child process")
    src = b.work / "budget_state.safetensors"
    write_state_file(b.state, src)
    out: dict[str, Any] = {"state_bytes": b.state_bytes, "budgets": {}}
    for f in FRACTIONS:
        root = b.fresh("budget", str(f))
        try:
            r = run_child(b, f, src, root)
        except Exception as exc:  # noqa: BLE001
            out["budgets"][str(f)] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            b.log(f"  !! budget {f}x: {exc}")
            continue
        r["within"] = r["peak_above_live"] <= r["budget"] + r["chunk_bytes"]
        out["budgets"][str(f)] = r
        b.log(
            f"  {f}x ({fmt_b(r['budget'])}): +{fmt_b(r['peak_above_live'])} above the live state "
            f"(limit {fmt_b(r['budget'] + r['chunk_bytes'])}); blocks {fmt_s(r['blocks'][0])}, "
            f"then {fmt_s(r['blocks'][1])} (predicted {fmt_s(r['predicted'])})"
        )
        shutil.rmtree(root, ignore_errors=True)
    src.unlink(missing_ok=True)
    b.extra["budget"] = out


def run_child(b: Bench, fraction: float, src: Path, root: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ENTRY),
        "--child-op",
        "async",
        "--child-budget",
        str(fraction),
        "--child-state",
        str(src),
        "--child-dir",
        str(root),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=b.args.child_timeout)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not line:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"child exited {p.returncode}: {err}")
    result: dict[str, Any] = json.loads(line[-1][len(RESULT_PREFIX) :])
    return result


# ---------------------------------------------------------------------------------------------
# child


class RssSampler:
    """The largest resident set size seen, read from ``/proc/self/statm`` every ``period``
    seconds on a thread of its own (between :meth:`start` and :meth:`stop`)."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self.samples += 1
            time.sleep(self.period)

    def start(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


def measure(fraction: float, state_file: str, directory: str) -> dict[str, Any]:
    import ckstore

    state = read_state_file(state_file)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    store = ckstore.open(Path(directory) / "store", create=True)
    app = {k: ckstore.StateDict(v) for k, v in state.items()}
    limit = int(fraction * nbytes)
    warm = {"w": ckstore.StateDict(x=_tensors(state)[0][:1].clone())}
    store.async_take(warm, run="warm").wait()  # the take's modules imported before measuring
    gc.collect()
    reset_ok = reset_peak_rss()
    live = proc_status("VmRSS")
    sampler = RssSampler().start()
    blocks, reports = [], []
    for step in range(2):
        t0 = time.perf_counter()
        pending = store.async_take(app, run="budget", step=step, staging_budget=limit)
        blocks.append(time.perf_counter() - t0)
        reports.append(pending.blocking)
        pending.wait()
        store.wait_compacted()
        for t in _tensors(state):
            t.add_(1)  # every byte changes: the second take stores as much as the first
    peak = max(sampler.stop(), proc_status("VmHWM") if reset_ok else 0)
    chunk = store.repository.config.chunk_bytes
    store.close()
    return {
        "fraction": fraction,
        "budget": limit,
        "state_bytes": nbytes,
        "chunk_bytes": chunk,
        "live_rss": live,
        "peak_rss": peak,
        "peak_above_live": max(0, peak - live),
        "samples": sampler.samples,
        "hwm_reset": reset_ok,
        "blocks": blocks,
        "reports": [r.to_dict() for r in reports],
        "predicted": reports[0].predict(nbytes),  # the second take, from the first's rates
    }


def _tensors(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return [state] if hasattr(state, "element_size") else []


def child_main(fraction: float, state_file: str, directory: str) -> int:
    """The child process's entry: measure, then print the result on one RESULT line."""
    print(RESULT_PREFIX + json.dumps(measure(fraction, state_file, directory)), flush=True)
    return 0
