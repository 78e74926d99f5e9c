"""Distributed takes and read-once restores of CUDA state (2 gloo ranks sharing one GPU):
per-rank, replicated and bf16 tensors come back bit-exact into CUDA destinations, atomic
within and past the memory budget, and atomic=False. Needs a CUDA device (skipped without).

The ranks are forked from a fresh interpreter (``tests/distributed/cuda_job.py``): CUDA cannot
be used in a child forked from a process that has initialised it, as pytest's has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_state_takes_and_restores_on_two_ranks(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed.cuda_job", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r and r["ok"] for r in res), res
    for r in res:
        assert r["value"] == {"world": 2, "atomic": True, "atomic_small_budget": True, "once": True}
