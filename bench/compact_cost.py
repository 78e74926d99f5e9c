"""What background compaction costs a take on the critical path (issue 21: at most 5%).

One store with compaction after takes (the default), the benchmark's transformer-shaped fp32
state and its Adam moments, every tensor changed before each take (full training: each take
leaves a whole state for compaction to pack, the worst case). Rounds alternate two kinds of
take of the same store:

- **idle**: the previous take's compaction has finished (``wait_compacted``), then ``--gap``
  seconds pass (training), then the take;
- **during**: only ``--gap`` seconds pass after the previous take, so its compaction is still
  running when the take starts (checked; a take that finds it done is reported, not counted).

Compaction waits while a take of the process runs (``Repository.busy``); what is left on the
critical path is the encode batch in flight when the take starts, and the memory and disk it
shares. The ratio of the medians is the figure; wall times on a shared 2-core machine swing,
so the process CPU time per take is printed beside them. The last compaction's report also
says what checking its payloads cost (each decoded and compared with the chunk before it goes
into a pack: issue 34, at most 25 % of compaction).

    python bench/compact_cost.py                       # 270 MiB, 8 rounds
    python bench/compact_cost.py --size-mb 1024 --rounds 6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckbench.states import build_state, iter_tensors, state_bytes  # noqa: E402

import ckstore  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=270, help="state size in MiB (default 270)")
    ap.add_argument("--rounds", type=int, default=8, help="takes of each kind (default 8)")
    ap.add_argument(
        "--gap",
        type=float,
        default=0.1,
        help="seconds of 'training' before each take (default 0.1)",
    )
    args = ap.parse_args(argv)
    state = build_state(args.size_mb << 20, seed=0)
    tensors = [t for _, t in iter_tensors(state) if t.is_floating_point()]
    root = Path(tempfile.mkdtemp(prefix="ckstore-compact-cost-"))
    times: dict[str, list[tuple[float, float]]] = {"idle": [], "during": []}
    missed = 0
    try:
        with ckstore.open(root / "store", create=True, auto_compact=True) as store:
            app = {k: ckstore.StateDict(v) for k, v in state.items()}
            store.take(app, run="r", step=0)
            store.wait_compacted()
            for i in range(1, 2 * args.rounds + 1):
                for t in tensors:  # full training: every element moves a little
                    t.mul_(1.0001)
                kind = "during" if i % 2 == 0 else "idle"
                if kind == "idle":
                    store.wait_compacted()
                time.sleep(args.gap)
                running = not store.wait_compacted(timeout=0)
                if kind == "during" and not running:
                    missed += 1
                    continue
                w0, c0 = time.perf_counter(), time.process_time()
                store.take(app, run="r", step=i)
                times[kind].append((time.perf_counter() - w0, time.process_time() - c0))
            store.wait_compacted()
            report = store.last_compaction
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"state {state_bytes(state) / 2**20:.0f} MiB, {args.rounds} rounds, gap {args.gap} s, "
        f"torch threads {torch.get_num_threads()}"
    )
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in times.items()
        if v
    }
    for k, (w, c) in med.items():
        print(
            f"  take, compaction {k:6s}: {w * 1e3:7.1f} ms wall, {c * 1e3:7.1f} ms CPU (median of {len(times[k])})"
        )
    if missed:
        print(f"  {missed} take(s) found the compaction already done (not counted): lower --gap")
    if report is not None:
        print(f"  last compaction: {report.raw_bytes / 2**20:.0f} MiB in {report.seconds:.2f} s")
        share = report.check_cpu_seconds / report.cpu_seconds if report.cpu_seconds else 0.0
        print(
            f"  its check of every payload it wrote (decoded, compared): "
            f"{report.check_cpu_seconds:.2f} s of {report.cpu_seconds:.2f} s CPU "
            f"({100 * share:.1f} %; target <= 25 %: {'PASS' if share <= 0.25 else 'MISS'}), "
            f"{report.encodings_refused} refused"
        )
    if "idle" in med and "during" in med:
        ratio = med["during"][0] / med["idle"][0]
        print(
            f"take while compaction runs / take with it idle: {ratio:.3f}x wall "
            f"(target <= 1.05x: {'PASS' if ratio <= 1.05 else 'MISS'}), {med['during'][1] / med['idle'][1]:.3f}x CPU"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
