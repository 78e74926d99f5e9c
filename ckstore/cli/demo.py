"""The main job: train a frozen-backbone model, snapshot it, resume bit-exactly elsewhere.

Phase 1 (this process) trains ``steps`` steps uninterrupted, taking a snapshot every ``every``
steps during the first half only, and records the loss of every step. Phase 2 runs in a fresh
Python process: it rebuilds the model from scratch, restores the latest snapshot (model,
optimizer, LR schedule, data position, every RNG) and trains the second half. The two loss
curves must agree bit for bit. Each snapshot stores only what changed: the head and its
optimizer state, never the frozen backbone again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import ckstore

from ..errors import CkstoreError, InvalidInputError
from . import _format as fmt

RUN = "demo"


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A ~14 MiB frozen backbone and a small trainable head, AdamW, and a cosine schedule."""
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(
        torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1536), torch.nn.GELU()
    )
    head = torch.nn.Sequential(
        torch.nn.Dropout(0.1), torch.nn.Linear(1536, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)
    )
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


def app_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, progress: ckstore.StateDict
) -> dict[str, Any]:
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "progress": progress,
        "rng": ckstore.RNGState(),
    }


@dataclass
class DemoResult:
    """What the demo did, for ``ckstore demo --json`` (and its exit code)."""

    store: str
    steps: int
    every: int
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    resumed_at: int = 0
    resumed_steps: int = 0
    identical_steps: int = 0
    commands: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bit_identical(self) -> bool:
        return self.resumed_steps == self.steps // 2 and self.identical_steps == self.resumed_steps

    @property
    def exit_code(self) -> int:
        """0 when the curves agree and every history command succeeded, else the first failure's
        code (1 if the curves differ)."""
        failed = [c["exit_code"] for c in self.commands if c["exit_code"] != 0]
        return failed[0] if failed else (0 if self.bit_identical else 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store, "steps": self.steps, "every": self.every,
            "snapshots": self.snapshots, "resumed_at": self.resumed_at,
            "resumed_steps": self.resumed_steps, "bit_identical": self.bit_identical,
            "commands": self.commands, "exit_code": self.exit_code,
        }  # fmt: skip


def check_schedule(steps: int, every: int) -> None:
    """Refuse a schedule that takes no snapshot before the resume point (phase 2 would have
    nothing to restore).

    Raises:
        InvalidInputError: the message says which values work.
    """
    if steps < 2:
        raise InvalidInputError(
            f"--steps must be at least 2 (the demo resumes halfway), got {steps}"
        )
    if not 1 <= every <= steps // 2:
        raise InvalidInputError(
            f"--every must be from 1 to --steps/2 = {steps // 2} (the demo snapshots during the "
            f"first half and resumes from there), got {every}"
        )


def phase1(result: DemoResult, say: Callable[[str], None]) -> list[float]:
    steps, every = result.steps, result.every
    model, opt, sched = build()
    progress = ckstore.StateDict(step=0)
    store = ckstore.open(result.store)
    say(f"store {store.url}: taking a snapshot every {every} steps up to step {steps // 2}\n")
    say(
        f"{'step':>5} {'loss':>9} {'logical':>11} {'new stored':>11} {'chunks new/reused':>18} {'take':>8}"
    )
    losses = []
    for step in range(1, steps + 1):
        losses.append(train_step(model, opt, sched, step))
        progress["step"] = step
        if step % every == 0 and step <= steps // 2:
            t0 = time.perf_counter()
            snap = store.take(
                app_state(model, opt, sched, progress),
                run=RUN,
                step=step,
                metadata={"loss": losses[-1]},
            )
            dt = time.perf_counter() - t0
            s = snap.stats
            result.snapshots.append({"step": step, "loss": losses[-1], "take_seconds": dt, **s})
            say(
                f"{step:>5} {losses[-1]:>9.5f} {fmt.size(s['logical_bytes']):>11} {fmt.size(s['new_bytes']):>11} "
                f"{s['new_chunks']:>8}/{s['reused_chunks']:<9} {dt:>7.3f}s"
            )
    store.close()
    return losses


def phase2(store_url: str, steps: int) -> list[float]:
    """Resume in this (fresh) process from the latest snapshot and train to ``steps``."""
    model, opt, sched = build(seed=12345)  # different init: everything must come from the snapshot
    progress = ckstore.StateDict(step=0)
    store = ckstore.open(store_url)
    snap = store.get(RUN)
    snap.restore(app_state(model, opt, sched, progress))
    start = progress["step"]
    losses = [train_step(model, opt, sched, step) for step in range(start + 1, steps + 1)]
    store.close()
    return losses


def resume_elsewhere(store_url: str, steps: int) -> list[float]:
    """Phase 2 in a fresh Python process; its losses.

    Raises:
        CkstoreError: the process failed; the message holds the end of what it printed.
    """
    cmd = [sys.executable, "-m", "ckstore.cli.demo", "--resume", store_url, str(steps)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        said = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:]) or "no output"
        raise CkstoreError(
            f"the demo's resume process failed (exit code {done.returncode}): {said}"
        )
    resumed: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return resumed


def main(
    store_url: str,
    run_cli: Callable[[list[str]], int],
    steps: int = 40,
    every: int = 5,
    say: Callable[[str], None] = print,
    as_json: bool = False,
) -> DemoResult:
    """Run both phases and compare, then browse the history with ``run_cli`` (the ``ckstore``
    command line's ``main``). ``store_url`` must be an empty store (``ckstore demo`` makes one
    with ``claim_demo_store``); ``say`` prints the transcript; ``as_json`` runs the history
    commands with ``--json`` and keeps their documents in the result.

    Raises:
        InvalidInputError: the schedule takes no snapshot to resume from (:func:`check_schedule`).
        CkstoreError: the resume process failed.
    """
    check_schedule(steps, every)
    result = DemoResult(store_url, steps, every)
    say("== phase 1: train, snapshotting as we go (frozen backbone: only the head changes)")
    losses = phase1(result, say)
    say("\n== phase 2: a fresh process restores the latest snapshot and continues")
    resumed = resume_elsewhere(store_url, steps)
    expected = losses[len(losses) - len(resumed) :]
    same = [a.hex() == b.hex() for a, b in zip(expected, resumed)]
    result.resumed_at, result.resumed_steps, result.identical_steps = (
        steps - len(resumed),
        len(resumed),
        sum(same),
    )
    say(
        f"resumed at step {result.resumed_at}, trained {len(resumed)} more steps in pid != {os.getpid()}"
    )
    say(f"{'step':>5} {'uninterrupted':>15} {'resumed':>15}")
    for i, (a, b) in enumerate(zip(expected, resumed)):
        if i < 3 or i >= len(resumed) - 2:
            say(f"{steps - len(resumed) + i + 1:>5} {a:>15.10f} {b:>15.10f}")
        elif i == 3:
            say(f"{'...':>5}")
    say(f"\nloss curves bit-identical: {result.bit_identical} ({sum(same)}/{len(same)} steps)")
    history(result, run_cli, say, as_json)
    return result


def history(
    result: DemoResult,
    run_cli: Callable[[list[str]], int],
    say: Callable[[str], None],
    as_json: bool,
) -> None:
    """Phase 3: browse and maintain the history with the ``ckstore`` command line."""

    def run(*args: str) -> None:
        say(f"\n$ ckstore {' '.join(args)}")
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = run_cli(["--store", result.store, *args, *(["--json"] if as_json else [])])
        text = buffer.getvalue()
        say(text.rstrip("\n"))
        entry: dict[str, Any] = {"command": ["ckstore", *args], "exit_code": code}
        if as_json and text.strip():
            entry["output"] = json.loads(text)
        result.commands.append(entry)

    store = ckstore.open(result.store)
    snaps = sorted(store.log(RUN), key=lambda s: s.step or 0)
    best = min(snaps, key=lambda s: s.metadata["loss"])
    store.close()
    say("\n== phase 3: history and maintenance with the ckstore command line")
    run("log")
    if len(snaps) >= 2:
        run("diff", f"{RUN}@{snaps[0].step}", f"{RUN}@{snaps[1].step}", "--numeric")
    else:
        say("\n(one snapshot only: no diff; a smaller --every takes more)")
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
