"""A training loop's DataLoader workers, forked while ckstore works behind it (an
``async_take`` finishing, the compaction after it), read a store themselves.

Before the fork gate (``ckstore/index/forks.py``) a worker forked while a background thread
was inside SQLite hung in its first SQLite call: 3 of 8 runs of this test failed with
"DataLoader timed out after 20 seconds"; 0 of 8 since.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ckstore


class _FromStore(Dataset):
    """Each item read from a store snapshot (a worker opens the store itself)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        with ckstore.open(self.url) as store:
            return store.get("data").read_object("d/x")[i]


@pytest.mark.skipif(
    sys.platform != "linux",
    reason="DataLoader workers by fork: Linux's default (macOS and Windows spawn)",
)
def test_dataloader_workers_forked_beside_background_takes_and_compaction(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    with ckstore.open(data, create=True) as s:
        s.take({"d": ckstore.StateDict(x=torch.arange(16.0).reshape(4, 4))}, run="data")
    store = ckstore.open(tmp_path / "ckpt", create=True, chunk_bytes=4096)
    model = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    pending = None
    for step in range(25):
        model["w"].add_(0.01)
        if pending is not None:
            pending.wait()
        pending = store.async_take({"m": ckstore.StateDict(model)}, run="r", step=step)
        loader = DataLoader(
            _FromStore(data),
            batch_size=2,
            num_workers=2,
            multiprocessing_context="fork",
            timeout=20,
        )
        got = torch.cat(list(loader))
        assert torch.equal(got, torch.arange(16.0).reshape(4, 4))
    pending.wait()
    store.close()
