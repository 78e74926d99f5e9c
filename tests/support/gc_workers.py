"""Worker processes for the GC-beside-writers tests (run as ``python -m tests.support.gc_workers`` from the repository root).

``take``: loops taking snapshots whose content is a function of the step (so any committed
snapshot can be verified later), with a changing part and a stable part, so dedup and GC both
have work. ``gc``: loops ``gc(keep_last=2, grace_seconds=0)``. ``compact``: loops
``compact(keep_loose=1)`` (re-encoding what the takes wrote loose, as deltas where smaller).
``pause``: one take that stops itself (SIGSTOP) right after the index pinned the chunks it
dedups against.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import ckstore


def state_for(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stable = torch.Generator().manual_seed(step // 4)  # changes every 4 steps: dedup + GC work
    return {
        "fresh": torch.randn(48, 32, generator=g),
        "slow": torch.randn(64, 32, generator=stable),
    }


def drifting_state_for(step: int) -> dict[str, torch.Tensor]:
    """A state whose every element drifts a little from step to step (a training run): what
    deltas against the parent are for. Still a function of the step."""
    base = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(48, 64, generator=torch.Generator().manual_seed(step))
    return {"w": base + 1e-3 * drift, "wb": (base + 1e-3 * drift).to(torch.bfloat16)}


def open_store(url: str, index: str) -> ckstore.Store:
    return ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True)


def take_loop(url: str, index: str, seconds: float, deltas: bool = False, run: str = "loop") -> int:
    store = open_store(url, index)
    store.delta_depth = 3  # chains of up to 3 links, their older links forgotten by the gc beside
    deadline, step, failures = time.time() + seconds, 0, 0
    while time.time() < deadline:
        step += 1
        try:
            if deltas:  # a chain per chunk, its older links forgotten by the gc beside
                store.take(
                    {"s": ckstore.StateDict(drifting_state_for(step))},
                    run=run,
                    step=step,
                    delta_base="parent",
                )
            else:
                store.take({"s": ckstore.StateDict(state_for(step))}, run=run, step=step)
        except ckstore.CkstoreError as exc:  # a take may lose a race with GC; never silently
            failures += 1
            print(f"take {step} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"took {step} failures {failures}")
    return 0


def gc_loop(url: str, index: str, seconds: float) -> int:
    store = open_store(url, index)
    deadline, runs = time.time() + seconds, 0
    while time.time() < deadline:
        store.gc(keep_last=2, grace_seconds=0, repack_below=0.6)
        runs += 1
    print(f"gc runs {runs}")
    return 0


def compact_loop(url: str, index: str, seconds: float) -> int:
    store = open_store(url, index)
    store.delta_depth = 3
    deadline, runs, switched = time.time() + seconds, 0, 0
    while time.time() < deadline:
        switched += store.compact(keep_loose=1).delta_chunks
        runs += 1
    print(f"compact runs {runs} deltas {switched}")
    return 0


def pause_after_pinning(url: str, index: str) -> int:
    store = open_store(url, index)
    real = store.repository.index.lookup_chunks

    def lookup_then_stop(session_id, ids):
        found = real(session_id, ids)
        os.kill(os.getpid(), signal.SIGSTOP)
        return found

    store.repository.index.lookup_chunks = lookup_then_stop  # type: ignore[method-assign]
    try:
        store.take({"s": ckstore.StateDict(state_for(1))}, run="paused", step=1)
    except ckstore.LeaseExpiredError as exc:
        print(f"LeaseExpiredError: {exc}")
        return 3
    return 0


if __name__ == "__main__":
    cmd, url, index = sys.argv[1], sys.argv[2], sys.argv[3]
    if cmd in ("take", "take-deltas"):
        run = sys.argv[5] if len(sys.argv) > 5 else "loop"
        sys.exit(take_loop(url, index, float(sys.argv[4]), deltas=cmd == "take-deltas", run=run))
    if cmd == "gc":
        sys.exit(gc_loop(url, index, float(sys.argv[4])))
    if cmd == "compact":
        sys.exit(compact_loop(url, index, float(sys.argv[4])))
    sys.exit(pause_after_pinning(url, index))
