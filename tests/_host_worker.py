"""One "host" of the many-writers test (run as ``python _host_worker.py MODE ...`` in its own cwd).

``take URL INDEX OPTS RUN STEPS``: takes one snapshot per step into RUN (content a function of
run and step, see :func:`state_for`), restores each one right after into a zeroed state and
compares the bits; prints one JSON line per committed snapshot and per failure.
``gc URL INDEX OPTS SECONDS``: runs retention (keep the last 3 of each run, 1 s grace) in a
loop until a file ``stop`` appears in its cwd (at most SECONDS); prints one JSON line per run
with the snapshots it dropped (``run@step``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import torch

import ckstore


def state_for(run: str, step: int) -> dict[str, torch.Tensor]:
    """A shared base (dedups across hosts), a part that changes every 3 steps, a fresh part."""
    seed = zlib.crc32(run.encode())
    return {
        "base": torch.randn(96, 32, generator=torch.Generator().manual_seed(7)),
        "slow": torch.randn(64, 32, generator=torch.Generator().manual_seed(seed + step // 3)),
        "fresh": torch.randn(48, 32, generator=torch.Generator().manual_seed(seed * 1000 + step)).to(torch.bfloat16),
    }


def open_store(url: str, index: str, opts: str) -> ckstore.Store:
    return ckstore.open(url, index=index, storage_options=json.loads(opts), chunk_bytes=1024, pack_bytes=8192)


def take(url: str, index: str, opts: str, run: str, steps: str) -> None:
    store = open_store(url, index, opts)
    for step in (int(s) for s in steps.split(",")):
        try:
            snap = store.take({"s": ckstore.StateDict(state_for(run, step))}, run=run, step=step)
            zero = {k: torch.zeros_like(v) for k, v in state_for(run, step).items()}
            target = ckstore.StateDict(zero)
            snap.restore({"s": target})
            exact = all(torch.equal(target[k], v) for k, v in state_for(run, step).items())
            print(json.dumps({"committed": snap.id, "run": run, "step": step, "restored_exact": exact}), flush=True)
        except ckstore.CkstoreError as exc:  # reported, never silent; the test counts them
            print(json.dumps({"failed": step, "run": run, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    store.close()


def gc(url: str, index: str, opts: str, seconds: str) -> None:
    store = open_store(url, index, opts)
    deadline = time.time() + float(seconds)
    while time.time() < deadline and not os.path.exists("stop"):
        report = store.gc(keep_last=3, grace_seconds=1.0)
        print(json.dumps({"dropped": report.snapshots_dropped, "packs_removed": report.packs_removed}), flush=True)
        time.sleep(0.3)
    store.close()


if __name__ == "__main__":
    {"take": take, "gc": gc}[sys.argv[1]](*sys.argv[2:])
