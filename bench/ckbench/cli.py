"""ckstore benchmark: ckstore against torch.save, safetensors, DCP, DCP+zstd and TorchSnapshot.

One deterministic state (a transformer-like fp32 model + Adam state), every system made durable
(each file written and its directory fsynced), systems interleaved within each round (the order
rotates every round) to cancel drift, medians over rounds. Scenarios: first save, save after 10%
of the weights changed (frozen backbone), restore in place (warm, cold, warm again after the cold
one), restore the weights alone, read one 64 MiB tensor, bytes on disk over successive saves,
peak RSS of save and restore (each in a child process), resume (a fresh
process builds the model, restores the latest snapshot and runs a first step, timed end to end),
async_take blocking time, compression of real trained weights (MiniLM, fp32 and bf16), and full
training (a small transformer trained with AdamW, a save every 10 steps, fp32 and bf16: bytes per
save, take time, restore of the last snapshot against the first; with ckstore+delta when this
ckstore's take has delta_base).

    python bench/run.py                  # 2 GiB state, 3 rounds
    python bench/run.py --quick          # 256 MiB state
    python bench/run.py --systems ckstore,safetensors --rounds 2
    python bench/run.py --only training  # the full-training phase alone

Writes ``<out>/results.json``, ``<out>/results.md``, ``<out>/bytes_over_saves.png`` and
``<out>/profile_take.txt``; prints the tables. The page cache is warm unless a row says cold
(each system's files evicted first with ``posix_fadvise(DONTNEED)``, no privileges needed),
equally for every system.
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
from .async_systems import ASYNC_SYSTEMS
from .harness import Bench
from .scenarios import PHASES, STATE_FREE
from .scenarios.budget import child_main as budget_child
from .scenarios.peak_rss import child_main
from .scenarios.resume import child_main as resume_child
from .systems import ALL_SYSTEMS, EXTRA_SYSTEMS, SYSTEM_CLASSES
from .util import BENCH_DIR

PHASE_NAMES = [name for name, _ in PHASES]
OVERHEAD_SYSTEMS = [n for n in ASYNC_SYSTEMS if n != "plain"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=int, default=2048, help="state size in MiB (default 2048)")
    ap.add_argument("--quick", action="store_true", help="a 256 MiB state")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--saves", type=int, default=5, help="saves in the bytes-on-disk scenario (default 5)"
    )
    ap.add_argument(
        "--out", default=str(BENCH_DIR / "out"), help="output directory (default bench/out)"
    )
    ap.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}",
    )
    ap.add_argument(
        "--skip", default="", help=f"comma-separated phases to skip: {','.join(PHASE_NAMES)}"
    )
    ap.add_argument("--only", default="", help="comma-separated phases to run, the others skipped")
    ap.add_argument(
        "--train-saves", type=int, default=6, help="saves in the training phase (default 6)"
    )
    ap.add_argument(
        "--train-every", type=int, default=10, help="training steps between saves (default 10)"
    )
    ap.add_argument(
        "--train-dim", type=int, default=384, help="the trained transformer's width (default 384)"
    )
    ap.add_argument("--train-layers", type=int, default=4, help="its layers (default 4)")
    ap.add_argument(
        "--overhead-mb",
        type=int,
        default=270,
        help="the training-loop phase's state (fp32 weights + AdamW) in MiB (default 270)",
    )
    ap.add_argument(
        "--overhead-ks",
        default="1,10,100",
        help="its intervals: steps between checkpoints (default 1,10,100)",
    )
    ap.add_argument(
        "--overhead-cycles",
        type=int,
        default=6,
        help="its cycles at k=10, a third as many at the other intervals (default 6)",
    )
    ap.add_argument(
        "--overhead-systems",
        default=",".join(OVERHEAD_SYSTEMS),
        help=f"its checkpointers, a subset of {','.join(OVERHEAD_SYSTEMS)}",
    )
    ap.add_argument(
        "--overhead-threads", type=int, default=1, help="its trainer's torch threads (default 1)"
    )
    ap.add_argument(
        "--overhead-device",
        default="cpu",
        help="where its model trains: cpu (default) or cuda (a GPU machine)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-profile", action="store_true", help="skip the cProfile of one ckstore take"
    )
    ap.add_argument("--child-timeout", type=int, default=600)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing peers")
    # the child processes (scenarios.peak_rss and scenarios.resume spawn bench/run.py with these)
    ap.add_argument(
        "--child-op", choices=("save", "restore", "resume", "async"), help=argparse.SUPPRESS
    )
    ap.add_argument("--child-budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--child-system", help=argparse.SUPPRESS)
    ap.add_argument("--child-state", help=argparse.SUPPRESS)
    ap.add_argument("--child-dir", help=argparse.SUPPRESS)
    ap.add_argument("--child-build", choices=("module", "tensors"), help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.child_op == "resume":
        return resume_child(
            args.child_system, args.child_dir, args.size_mb, args.child_build or "tensors"
        )
    if args.child_op == "async":
        return budget_child(args.child_budget, args.child_state, args.child_dir)
    if args.child_op:
        return child_main(args.child_op, args.child_system, args.child_state, args.child_dir)
    if args.quick:
        args.size_mb = 256
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEM_CLASSES]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS + EXTRA_SYSTEMS)}")
    args.skip = phase_list(ap, "--skip", args.skip)
    only = phase_list(ap, "--only", args.only)
    if only:
        args.skip = sorted(set(args.skip) | (set(PHASE_NAMES) - set(only)))
    if args.train_saves < 1 or args.train_every < 1:
        ap.error("--train-saves and --train-every must be at least 1")
    overhead_args(ap, args)
    torch.manual_seed(args.seed)
    return run(Bench(args))


def overhead_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The training-loop phase's lists, parsed and checked in place."""
    try:
        args.overhead_ks = [int(k) for k in args.overhead_ks.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--overhead-ks: comma-separated step counts, got {args.overhead_ks!r}")
    if not args.overhead_ks or min(args.overhead_ks) < 1 or args.overhead_cycles < 1:
        ap.error("--overhead-ks and --overhead-cycles must be at least 1")
    args.overhead_systems = [s.strip() for s in args.overhead_systems.split(",") if s.strip()]
    unknown = [s for s in args.overhead_systems if s not in OVERHEAD_SYSTEMS]
    if unknown:
        ap.error(
            f"--overhead-systems: unknown {unknown}; choose from {', '.join(OVERHEAD_SYSTEMS)}"
        )


def phase_list(ap: argparse.ArgumentParser, flag: str, text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in PHASE_NAMES]
    if unknown:
        ap.error(f"{flag}: unknown phases {unknown}; choose from {', '.join(PHASE_NAMES)}")
    return names


def run(b: Bench) -> int:
    """Every phase not skipped (a failing phase is reported and the run goes on), then the
    results written to ``<out>`` and the tables printed."""
    t0 = time.perf_counter()
    b.out.mkdir(parents=True, exist_ok=True)
    skip = set(b.args.skip)
    b.setup(state=any(name not in skip | STATE_FREE for name in PHASE_NAMES))
    if not b.systems:
        b.log("no system available")
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
    b.log(
        f"wrote {b.out / 'results.json'}, {b.out / 'results.md'}"
        + (f", {png}" if png else "")
        + f" in {res['total_seconds']:.0f} s"
    )
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
