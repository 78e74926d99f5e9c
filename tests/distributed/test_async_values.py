"""A distributed async_take stores the state's ``bytearray`` and ``io.BytesIO`` values as they
were at the call. Its staging shared every leaf that is not a tensor, array or container, and
these two change in place: they were encoded only when the background thread planned the take,
so the training loop's later writes leaked into the snapshot."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

import ckstore
from tests.support.ranks import run_ranks, values

TINY = {"chunk_bytes": 4096, "pack_bytes": 1 << 16, "inline_bytes": 64}


def _rank(rank: int, world: int, path: str) -> dict[str, Any]:
    store = ckstore.open(path, **TINY, create=True)
    first = store.async_take(
        {"s": ckstore.StateDict(w=torch.randn(256, 256))}, run="r", step=1
    )  # in flight: the next take runs on the same background thread after it
    state = ckstore.StateDict(
        w=torch.zeros(16), blob=bytearray(b"old-bytes"), bio=io.BytesIO(b"old-bio")
    )
    pending = store.async_take({"s": state}, run="r", step=2)
    state["blob"][:3] = b"NEW"  # the training loop goes on
    state["bio"].seek(0)
    state["bio"].write(b"NEW")
    first.wait(120)
    snap = pending.wait(120)
    target = ckstore.StateDict(w=torch.ones(16), blob=bytearray(), bio=io.BytesIO())
    snap.restore({"s": target})
    store.close()
    return {"blob": bytes(target["blob"]).decode(), "bio": target["bio"].getvalue().decode()}


def test_distributed_async_take_stores_mutable_values_as_at_the_call(tmp_path: Path) -> None:
    results = values(run_ranks(_rank, 1, tmp_path, str(tmp_path / "store")))
    assert results[0] == {"blob": "old-bytes", "bio": "old-bio"}
