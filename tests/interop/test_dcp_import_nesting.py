"""Importing a DCP directory whose ``.metadata`` holds an inconsistent ``planner_data``.

The nesting map comes from the checkpoint: a huge list index made the import allocate a list
of that length, and a path that is both a leaf and a container raised TypeError. Such a map is
now ignored and the import keeps DCP's flat keys, as it does for a missing map.
"""

from __future__ import annotations

import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore


def _dcp_dir(tmp_path: Path, planner_data: Any) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "extra": {"b": torch.ones(2)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    meta_path = path / ".metadata"
    md = pickle.loads(meta_path.read_bytes())  # noqa: S301 - the test's own file
    assert set(md.planner_data) == {"model.w", "extra.b"}
    md.planner_data = planner_data
    meta_path.write_bytes(pickle.dumps(md))
    return path


@pytest.mark.parametrize(
    "planner_data",
    [
        {
            "model.w": ("model", 10**7),
            "extra.b": ("extra", "b"),
        },  # a list index far past the leaves
        {"model.w": ("model",), "extra.b": ("model", "b")},  # "model": a leaf and a dict at once
        {"model.w": ("model", "w"), "extra.b": ("model", 0)},  # "model": a dict and a list at once
        {"model.w": (0, "w"), "extra.b": ("extra", "b")},  # the root indexed as a list
        {"model.w": ("model", True), "extra.b": ("extra", "b")},  # a bool is no index
    ],
)
def test_an_inconsistent_nesting_map_keeps_the_flat_keys(tmp_path: Path, planner_data: Any) -> None:
    path = _dcp_dir(tmp_path, planner_data)
    store = ckstore.open(tmp_path / "s", create=True)
    started = time.monotonic()
    snap = store.import_checkpoint(path, run="r", format="dcp")
    assert time.monotonic() - started < 60
    assert {"model/model.w", "model/extra.b"} <= set(snap.get_manifest())  # one flat app
    assert torch.equal(snap.read_object("model/model.w"), torch.arange(12.0).reshape(3, 4))
    store.close()


def test_a_consistent_nesting_map_still_nests(tmp_path: Path) -> None:
    path = _dcp_dir(tmp_path, {"model.w": ("model", "w"), "extra.b": ("extra", "b")})
    store = ckstore.open(tmp_path / "s", create=True)
    snap = store.import_checkpoint(path, run="r", format="dcp")
    assert torch.equal(snap.read_object("model/w"), torch.arange(12.0).reshape(3, 4))
    store.close()
