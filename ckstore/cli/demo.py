"""The main job: train a frozen-backbone model, snapshot it, resume bit-exactly elsewhere.

Phase 1 (this process) trains ``steps`` steps uninterrupted, taking a snapshot every ``every``
steps during the first half only, and records the loss of every step. Phase 2 runs in a fresh
Python process: it rebuilds the model from scratch, restores the latest snapshot (model,
optimizer, LR schedule, data position, every RNG) and trains the second half. The two loss
curves must agree bit for bit. Each snapshot stores only what changed: the head and its
optimizer state, never the frozen backbone again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import ckstore

RUN = "demo"


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A ~17 MB frozen backbone and a small trainable head, AdamW, and a cosine schedule."""
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(
        torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1536), torch.nn.GELU()
    )
    head = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(1536, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    model = torch.nn.Sequential(backbone, head)
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data at a given step (the loader's position is just the step counter)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 256, generator=g)
    return x, (x[:, :10].sum(dim=1) > 0).long() + (x[:, 10] > 1).long() * 2


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, progress: ckstore.StateDict) -> dict[str, Any]:
    return {"model": model, "optim": opt, "sched": sched, "progress": progress, "rng": ckstore.RNGState()}


def _mb(n: int) -> str:
    return f"{n / 1e6:8.2f} MB"


def phase1(store_url: str, steps: int, every: int) -> list[float]:
    model, opt, sched = build()
    progress = ckstore.StateDict(step=0)
    store = ckstore.open(store_url)
    print(f"store {store.url}: taking a snapshot every {every} steps up to step {steps // 2}\n")
    print(f"{'step':>5} {'loss':>9} {'logical':>11} {'new stored':>11} {'chunks new/reused':>18} {'take':>8}")
    losses = []
    for step in range(1, steps + 1):
        losses.append(train_step(model, opt, sched, step))
        progress["step"] = step
        if step % every == 0 and step <= steps // 2:
            t0 = time.perf_counter()
            snap = store.take(app_state(model, opt, sched, progress), run=RUN, step=step, metadata={"loss": losses[-1]})
            dt = time.perf_counter() - t0
            s = snap.stats
            print(
                f"{step:>5} {losses[-1]:>9.5f} {_mb(s['logical_bytes']):>11} {_mb(s['new_bytes']):>11} "
                f"{s['new_chunks']:>8}/{s['reused_chunks']:<9} {dt:>7.3f}s"
            )
    store.close()
    return losses


def phase2(store_url: str, steps: int) -> list[float]:
    """Resume in this (fresh) process from the latest snapshot and train to ``steps``."""
    model, opt, sched = build(seed=12345)  # different init: everything must come from the snapshot
    progress = ckstore.StateDict(step=0)
    store = ckstore.open(store_url, create=False)
    snap = store.get(RUN)
    snap.restore(app_state(model, opt, sched, progress))
    start = progress["step"]
    losses = [train_step(model, opt, sched, step) for step in range(start + 1, steps + 1)]
    store.close()
    return losses


def main(store_url: str, run_cli: Callable[[list[str]], int], steps: int = 40, every: int = 5) -> int:
    """Run both phases and compare, then browse the history with ``run_cli`` (the ``ckstore``
    command line's ``main``); returns a process exit code. ``store_url`` must be an empty store
    (``ckstore demo`` makes one with ``claim_demo_store``)."""
    print("== phase 1: train, snapshotting as we go (frozen backbone: only the head changes)")
    losses = phase1(store_url, steps, every)
    print("\n== phase 2: a fresh process restores the latest snapshot and continues")
    cmd = [sys.executable, "-m", "ckstore.cli.demo", "--resume", store_url, str(steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    resumed = json.loads(out.strip().splitlines()[-1])
    expected = losses[len(losses) - len(resumed):]
    same = [a.hex() == b.hex() for a, b in zip(expected, resumed)]
    print(f"resumed at step {steps - len(resumed)}, trained {len(resumed)} more steps in pid != {os.getpid()}")
    print(f"{'step':>5} {'uninterrupted':>15} {'resumed':>15}")
    for i, (a, b) in enumerate(zip(expected, resumed)):
        if i < 3 or i >= len(resumed) - 2:
            print(f"{steps - len(resumed) + i + 1:>5} {a:>15.10f} {b:>15.10f}")
        elif i == 3:
            print(f"{'...':>5}")
    ok = all(same) and len(resumed) == steps // 2
    print(f"\nloss curves bit-identical: {ok} ({sum(same)}/{len(same)} steps)")
    history(store_url, every, run_cli)
    return 0 if ok else 1


def history(store_url: str, every: int, run_cli: Callable[[list[str]], int]) -> None:
    """Phase 3: browse and maintain the history with the ``ckstore`` command line."""

    def run(*args: str) -> None:
        print(f"\n$ ckstore {' '.join(args)}")
        run_cli(["--store", store_url, *args])

    store = ckstore.open(store_url, create=False)
    best = min(store.log(RUN), key=lambda s: s.metadata["loss"])
    store.close()
    print("\n== phase 3: history and maintenance with the ckstore command line")
    run("log")
    run("diff", f"{RUN}@{every}", f"{RUN}@{2 * every}", "--numeric")
    run("tag", f"{RUN}@{best.step}", "best")
    run("du")
    run("gc", "--keep-last", "1", "--grace", "0s")
    run("log")
    run("du")
    run("check", "--read-data")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--resume":  # phase 2's entry point only
        raise SystemExit("run the demo with `ckstore demo` (this module is its phase 2)")
    print(json.dumps([float(x) for x in phase2(sys.argv[2], int(sys.argv[3]))]))
