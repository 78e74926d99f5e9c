"""Resume after a failure: a fresh process builds the model, restores the latest snapshot and runs
its first training step, timed end to end (interpreter start and imports included), for every
system side by side. Each system saves twice first (untimed; the second save is the latest
snapshot); the children run interleaved, ``--rounds`` times, the order rotating every round."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from ..harness import Bench
from ..states import empty_like_shapes, model_shapes, mutate
from ..systems import SYSTEM_CLASSES
from ..util import BENCH_DIR, fmt_s

ENTRY = BENCH_DIR / "run.py"
RESULT_PREFIX = "RESUME "


def resume(b: Bench) -> None:
    b.log("resume in a fresh process (build the model, restore the latest snapshot, first step)")
    roots = {}
    for n in b.order(0):
        if not b.ok(n):
            continue
        root = b.fresh("resume", n.replace("+", "_"))
        try:
            b.systems[n].prepare(root)
            b.systems[n].save(b.state, root, 0)
            mutate(b.state, b.trainable, seed=9000)
            b.systems[n].save(b.state, root, 1)
            b.systems[n].close(root)
            roots[n] = root
        except Exception as exc:  # noqa: BLE001
            b.log(f"  !! {n}: saving for the resume scenario failed: {type(exc).__name__}: {exc}")
    phases: dict[str, list[dict[str, float]]] = {}
    for r in range(b.args.rounds):
        for n in [n for n in b.order(r) if n in roots]:
            try:
                wall, res = run_child(b, n, str(roots[n]))
            except Exception as exc:  # noqa: BLE001
                b.log(f"  !! {n} resume child failed: {exc}")
                continue
            b.record("resume", n, wall)
            phases.setdefault(n, []).append(res)
    for n, rows in phases.items():
        med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
        b.log(f"  {n}: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in med.items()))
    b.extra["resume_phases"] = phases
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)


def run_child(b: Bench, n: str, root: str) -> tuple[float, dict[str, float]]:
    cmd = [
        sys.executable,
        str(ENTRY),
        "--child-op",
        "resume",
        "--child-system",
        n,
        "--child-dir",
        root,
        "--size-mb",
        str(b.args.size_mb),
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=b.args.child_timeout)
    wall = time.perf_counter() - t0
    line = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not line:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"child exited {p.returncode}: {err}")
    return wall, json.loads(line[-1][len(RESULT_PREFIX) :])


def first_step(state: dict[str, Any]) -> None:
    """One optimizer-like step over every parameter and its Adam moments."""
    with torch.no_grad():
        for k, p in state["model"].items():
            st = state["optim"]["state"][k]
            st["exp_avg"].mul_(0.9)
            st["exp_avg_sq"].mul_(0.999)
            p.add_(st["exp_avg"], alpha=-1e-3)
            st["step"].add_(1.0)


def child_main(system: str, directory: str, size_mb: int) -> int:
    """The child: build, restore the latest snapshot, step; print the phases on one line."""
    from pathlib import Path

    t0 = time.perf_counter()
    sys_ = SYSTEM_CLASSES[system]()
    sys_.setup()
    t1 = time.perf_counter()
    state = empty_like_shapes(model_shapes(size_mb << 20))
    t2 = time.perf_counter()
    root = Path(directory)
    sys_.prepare(root)
    sys_.restore(sys_.handle(root, 1), state)
    t3 = time.perf_counter()
    first_step(state)
    t4 = time.perf_counter()
    sys_.close(root)
    res = {"import": t1 - t0, "build": t2 - t1, "restore": t3 - t2, "step": t4 - t3}
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0
