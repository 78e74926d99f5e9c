"""The job of ``test_dist_cuda.py``, run as ``python -m tests.distributed.cuda_job TMP`` in a fresh
interpreter that never touches CUDA itself, so that the ranks it forks may: prints each rank's
result as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import ckstore
from tests.support.ranks import run_ranks


def _cuda_take_and_restores(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(rank)
    mine = torch.randn(4096, 256, device="cuda", generator=g)
    shared = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    b16 = torch.randn(3000, 7, device="cuda", generator=g).bfloat16()
    store = ckstore.open(path)
    snap = store.take(
        {"m": ckstore.StateDict(mine=mine, shared=shared, b16=b16)},
        run="r",
        step=1,
        replicated=["m/shared"],
    )
    out: dict[str, Any] = {"world": snap.record.world_size}
    for name, kw in (
        ("atomic", {}),
        ("atomic_small_budget", {"memory_budget": 1 << 20}),
        ("once", {"atomic": False}),
    ):
        dest = {
            "m": ckstore.StateDict(
                mine=torch.zeros_like(mine),
                shared=torch.zeros_like(shared),
                b16=torch.zeros_like(b16),
            )
        }
        store.get("r").restore(dest, **kw)
        d = dest["m"]
        out[name] = bool(
            torch.equal(d["mine"], mine)
            and torch.equal(d["shared"], shared)
            and torch.equal(d["b16"], b16)
            and d["mine"].is_cuda
        )
    store.close()
    return out


def _job(tmp: Path) -> list[Any]:
    path = str(tmp / "store")
    ckstore.open(path, create=True, chunk_bytes=1 << 18).close()
    return run_ranks(_cuda_take_and_restores, 2, tmp, path, timeout=300)


def _job(tmp: Path) -> list[Any]:
    path = str(tmp / "store")
    ckstore.open(path, create=True, chunk_bytes=1 << 18).close()
    return run_ranks(_cuda_take_and_restores, 2, tmp, path, timeout=300)


if __name__ == "__main__":
    print(json.dumps(_job(Path(sys.argv[1]))))
