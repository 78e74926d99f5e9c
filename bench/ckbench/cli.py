"""ckstore benchmark: ckstore against torch.save, safetensors, DCP, DCP+zstd and TorchSnapshot.

One deterministic state (a transformer-like fp32 model + Adam state), every system made durable
(each file written and its directory fsynced), systems interleaved within each round (the order
rotates every round) to cancel drift, medians over rounds. Scenarios: first save, save after 10%
of the weights changed (frozen backbone), restore in place, read one 64 MiB tensor, bytes on disk
over successive saves, peak RSS of save and restore (each in a child process), resume (a fresh
process builds the model, restores the latest snapshot and runs a first step, timed end to end),
async_take blocking time, and compression of real trained weights (MiniLM, fp32 and bf16).

    python bench/run.py                  # 2 GiB state, 3 rounds
    python bench/run.py --quick          # 256 MiB state
    python bench/run.py --systems ckstore,safetensors --rounds 2

Writes ``<out>/results.json``, ``<out>/results.md``, ``<out>/bytes_over_saves.png`` and
``<out>/profile_take.txt``; prints the tables. The page cache is warm throughout (it cannot be
dropped without privileges), equally for every system.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import traceback
from collections.abc import Callable

import torch

from . import report
from .harness import Bench
from .scenarios import PHASES
from .scenarios.peak_rss import child_main
from .scenarios.resume import child_main as resume_child
from .systems import ALL_SYSTEMS, SYSTEM_CLASSES
from .util import BENCH_DIR


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=2048, help="state size in MiB (default 2048)")
    ap.add_argument("--quick", action="store_true", help="a 256 MiB state")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--saves", type=int, default=5, help="saves in the bytes-on-disk scenario (default 5)")
    ap.add_argument("--out", default=str(BENCH_DIR / "out"), help="output directory (default bench/out)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: rounds,bytes,rss,resume,minilm,profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of one ckstore take")
    ap.add_argument("--child-timeout", type=int, default=600)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing peers")
    # the child processes (scenarios.peak_rss and scenarios.resume spawn bench/run.py with these)
    ap.add_argument("--child-op", choices=("save", "restore", "resume"), help=argparse.SUPPRESS)
    ap.add_argument("--child-system", help=argparse.SUPPRESS)
    ap.add_argument("--child-state", help=argparse.SUPPRESS)
    ap.add_argument("--child-dir", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.child_op == "resume":
        return resume_child(args.child_system, args.child_dir, args.size_mb)
    if args.child_op:
        return child_main(args.child_op, args.child_system, args.child_state, args.child_dir)
    if args.quick:
        args.size_mb = 256
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEM_CLASSES]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
    args.skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    torch.manual_seed(args.seed)
    return run(Bench(args))


def run(b: Bench) -> int:
    """Every phase not skipped (a failing phase is reported and the run goes on), then the
    results written to ``<out>`` and the tables printed."""
    t0 = time.perf_counter()
    b.out.mkdir(parents=True, exist_ok=True)
    b.setup()
    if not b.systems:
        b.log("no system available")
    skip = set(b.args.skip)
    for name, fn in PHASES:
        if name not in skip:
            run_phase(b, name, fn)
    res = report.results(b)
    res["total_seconds"] = time.perf_counter() - t0
    md = report.markdown(b, res)
    (b.out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (b.out / "results.md").write_text(md)
    png = report.chart(b)
    shutil.rmtree(b.work, ignore_errors=True)
    print()
    print(md)
    b.log(f"wrote {b.out / 'results.json'}, {b.out / 'results.md'}"
          + (f", {png}" if png else "") + f" in {res['total_seconds']:.0f} s")
    return 0


def run_phase(b: Bench, name: str, fn: Callable[[Bench], None]) -> None:
    tp = time.perf_counter()
    try:
        fn(b)
    except Exception as exc:  # noqa: BLE001 - report what we have
        b.log(f"!! phase {name} failed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        b.extra.setdefault("phase_errors", {})[name] = f"{type(exc).__name__}: {exc}"
    b.extra.setdefault("phase_seconds", {})[name] = time.perf_counter() - tp
