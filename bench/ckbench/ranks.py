"""Forked gloo ranks over one new store, for the distributed benches (``replica_check.py``,
``dist_async.py``)."""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

import ckstore


def on_ranks(fn: Callable[..., None], world: int, args: Any, prefix: str) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, port, store_path, args, out)`` on ``world`` forked ranks, over a
    store made in a temporary folder (background compaction off); each rank writes its result
    as JSON to ``out/rank{rank}.json``. Returns every rank's result, in rank order."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = str(Path(tmp) / "store")
        ckstore.open(path, create=True, auto_compact=False).close()
        out = Path(tmp) / "out"
        out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            fn, args=(world, port, path, args, str(out)), nprocs=world, start_method="fork"
        )
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
