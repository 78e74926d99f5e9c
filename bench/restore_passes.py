"""The passes of a restore, side by side on one store: what payload digests save an atomic restore.

One ckstore store holds one snapshot of the benchmark state; ``torch.save`` writes the same
state to a file. Each round restores it, in an order that rotates every round:

* ``atomic``: the default restore. Past its staging memory it checks stored payloads against
  the digests their writer recorded and decodes each chunk once (docs/RELIABILITY.md, I3).
* ``atomic, no digests``: the same snapshot after its index rows lost their digests (as in a
  store written before index revision 0003, or reindexed): every chunk past the staging memory
  is decoded to verify it, then decoded again into place.
* ``atomic=False``: one pass straight into place.
* ``torch.load(mmap)+copy_``: the unverified peer.

Prints medians of wall and CPU time (``time.process_time``, steadier than wall time on a
loaded machine) and the ratios.

    python bench/restore_passes.py                 # 256 MiB, 5 rounds
    python bench/restore_passes.py --size-mb 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckbench.states import build_state, empty_like_state, scramble  # noqa: E402
from ckbench.systems import TorchSave  # noqa: E402

import ckstore  # noqa: E402


def _app(state: dict[str, Any]) -> dict[str, Any]:
    return {k: ckstore.StateDict(v) for k, v in state.items()}


def _without_digests(root: Path) -> ckstore.Store:
    """A copy of the store at ``root`` whose chunk rows carry no payload digest."""
    from sqlalchemy import text

    copy = root.parent / "no-digests"
    shutil.copytree(root, copy)
    store = ckstore.open(copy)
    with store.repository.index._engine.begin() as conn:  # noqa: SLF001 - a benchmark's own store
        conn.execute(text("UPDATE chunks SET payload_digest = NULL"))
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    state = build_state(args.size_mb << 20, args.seed)
    work = Path(tempfile.mkdtemp(prefix="ckbench-passes-"))
    try:
        store = ckstore.open(work / "store", create=True)
        store.take(_app(state), run="bench")
        plain = _without_digests(work / "store")
        peer = TorchSave()
        (work / "peer").mkdir()
        handle = peer.save(state, work / "peer", 0)
        dest = empty_like_state(state)
        runs: dict[str, Callable[[], None]] = {
            "atomic": lambda: store.get("bench").restore(_app(dest)),
            "atomic, no digests": lambda: plain.get("bench").restore(_app(dest)),
            "atomic=False": lambda: store.get("bench").restore(_app(dest), atomic=False),
            "torch.load(mmap)+copy_": lambda: peer.restore(handle, dest),
        }
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        names = list(runs)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                scramble(dest)
                c0, t0 = time.process_time(), time.perf_counter()
                runs[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        w = {k: statistics.median(v) for k, v in wall.items()}
        c = {k: statistics.median(v) for k, v in cpu.items()}
        print(
            f"restore of a {args.size_mb} MiB state, {args.rounds} rounds, medians "
            f"({os.cpu_count()} CPUs, threads={store.threads})"
        )
        print(
            f"{'':26s} {'wall':>9s} {'cpu':>9s} {'wall / atomic=False':>20s} {'wall / peer':>12s}"
        )
        for k in runs:
            print(
                f"{k:26s} {w[k] * 1e3:7.0f}ms {c[k] * 1e3:7.0f}ms {w[k] / w['atomic=False']:19.2f}x "
                f"{w[k] / w['torch.load(mmap)+copy_']:11.2f}x"
            )
        print(
            f"digests save an atomic restore {1 - w['atomic'] / w['atomic, no digests']:.0%} of its wall time "
            f"and {1 - c['atomic'] / c['atomic, no digests']:.0%} of its CPU time"
        )
        store.close()
        plain.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
