"""Every export loads with its format's own safe loader, whatever stateful it holds (issue 27, item 1).

``RNGState`` (recommended by the demo and the docs) holds NumPy's generator state as an array,
which ``torch.load``'s default ``weights_only=True`` refuses: the torch export writes it as a
tensor. Each format is loaded here the safe way: ``torch.load(path)`` (weights only, the default
since PyTorch 2.6), ``safetensors.torch.load_file``, and ``dcp.load`` with every non-tensor
item unpickled ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckstore


def _kinds() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "module": model,
        "optimizer": optim,
        "scheduler": torch.optim.lr_scheduler.StepLR(optim, 3),
        "statedict": ckstore.StateDict(step=3, name="x", values=[1, 2.5], t=torch.ones(2)),
        "rng": ckstore.RNGState(),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("safe") / "store"
    with ckstore.open(path, create=True) as s:
        for name, stateful in _kinds().items():
            s.take({name: stateful}, run=name)
        s.take(_kinds(), run="all")
        yield s


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with ``weights_only=False``; this one
    refuses anything a weights-only load would."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _dcp_load(path: Path) -> dict[str, object]:
    meta = FileSystemReader(str(path)).read_metadata()
    state: dict[str, object] = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        if isinstance(m, TensorStorageMetadata)
        else None
        for k, m in meta.state_dict_metadata.items()
    }
    dcp.load(
        state,
        checkpoint_id=str(path),
        planner=_WeightsOnlyPlanner(flatten_state_dict=False),
        no_dist=True,
    )
    return state


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
@pytest.mark.parametrize("kind", ["module", "optimizer", "scheduler", "statedict", "rng", "all"])
def test_each_export_loads_with_the_formats_safe_loader(store, tmp_path, fmt, kind) -> None:
    out = tmp_path / "out"
    store.get(kind).export(out, fmt)
    if fmt == "torch":
        loaded = torch.load(out / "checkpoint.pt")  # the default: weights_only=True
        assert isinstance(loaded, dict) and loaded
        if kind in ("rng", "all"):
            numpy_state = loaded["rng"]["numpy"]
            assert isinstance(numpy_state[1], torch.Tensor) and numpy_state[1].dtype == torch.uint32
            assert np.array_equal(
                numpy_state[1].numpy(), store.get(kind).read_object("rng/numpy/1")
            )
    elif fmt == "safetensors":
        files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        assert files or kind == "scheduler"  # a scheduler holds no tensor: nothing to write
        for f in files:
            load_file(out / f)
    else:
        assert _dcp_load(out)


def test_an_exported_rng_state_restores_the_generators(store, tmp_path) -> None:
    """The tensor written for NumPy's state still sets NumPy's generator."""
    store.get("rng").export(tmp_path / "out", "torch")
    loaded = torch.load(tmp_path / "out" / "checkpoint.pt")
    np.random.seed(123)
    ckstore.RNGState().load_state_dict(loaded["rng"])
    after = np.random.random(3)
    ckstore.RNGState().load_state_dict(store.get("rng").get_state_dict_for_key("rng"))
    assert np.array_equal(np.random.random(3), after)
