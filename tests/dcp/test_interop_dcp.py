"""A DCP checkpoint written by 2 real ranks with DCP's own FileSystemWriter imports into a store,
restores on 3 ranks, and exports back to a directory that ``dcp.load`` reads on 1 rank.

The export keeps DCP's shards (each sharded tensor is written in the 2 chunks the 2 ranks
saved), and a second import of the same directory adds no chunk.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckstore
from ckstore.interop._safeload import load_dcp_metadata
from tests.dcp import interop_scenarios as scen
from tests.dcp import scenarios as ds
from tests.support.ranks import run_ranks, values
from tests.support.states import bits

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_dcp_two_ranks_import_restore_three_export_load_one(tmp_path: Path) -> None:
    src = tmp_path / "dcp-2ranks"
    assert values(run_ranks(scen.write_dcp, 2, tmp_path, str(src))) == [True, True]

    store_path = tmp_path / "store"
    store = ckstore.open(store_path, **ds.TINY, create=True)
    snap = store.import_checkpoint(src, run="titan", step=5)
    assert snap.metadata["imported_from"]["format"] == "dcp"
    assert snap.read_object("progress") == {"step": 5, "lr": 0.25}
    g = ds.global_state()
    for k, t in g.items():
        assert bits(snap.read_object(f"model/{k}")) == bits(t), k
    again = store.import_checkpoint(src, run="titan", step=6)
    assert again.stats["new_chunks"] == 0
    store.close()

    restored = values(run_ranks(scen.restore, 3, tmp_path, str(store_path), snap.id))
    assert all(r["progress"] == {"step": 5, "lr": 0.25} for r in restored)

    out = tmp_path / "exported"
    with ckstore.open(store_path, create=True) as store:
        store.get(snap.id).export(out, "dcp")
    md = load_dcp_metadata(str(out / ".metadata"))
    written = load_dcp_metadata(str(src / ".metadata"))
    for k in ("w", "uneven", "bf"):  # sharded tensors keep the 2 ranks' shards
        fqn = f"model.{k}"
        assert len(md.state_dict_metadata[fqn].chunks) == 2
        assert md.state_dict_metadata[fqn].chunks == written.state_dict_metadata[fqn].chunks

    target = {
        "model": {k: torch.zeros_like(t) for k, t in g.items()},
        "progress": {"step": 0, "lr": 0.0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(out)))
    assert target["progress"] == {"step": 5, "lr": 0.25}
    for k, t in g.items():
        assert bits(target["model"][k]) == bits(t), k
