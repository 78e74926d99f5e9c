"""``get_state_dict_for_key`` on a snapshot written by ``dcp.save``.

Such a snapshot has one app, ``"dcp"`` (DCP's flat FQNs); ``restore({"model": m})`` maps onto
it, but ``get_state_dict_for_key("model")`` said the key was missing. It now rebuilds the
state given to ``dcp.save`` under that key from the paths DCP recorded. An unknown key still
raises KeyNotFoundError (a KeyError; TorchSnapshot raises AssertionError), naming the keys the
snapshot has.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.errors import KeyNotFoundError


def test_state_dict_for_key_of_a_dcp_save(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    store = ckstore.open(tmp_path / "s", create=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    state = {
        "model": model.state_dict(),
        "step": 7,
        "sched": {"lrs": [0.1, 0.2], "ws": [torch.ones(2), torch.zeros(1)]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=StorageWriter(store, run="d", step=1), no_dist=True)
    snap = ckstore.Snapshot.of(store.get("d"))
    got = snap.get_state_dict_for_key("model")
    assert set(got) == set(model.state_dict())
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert snap.get_state_dict_for_key("step") == 7
    sched = snap.get_state_dict_for_key("sched")
    assert sched["lrs"] == [0.1, 0.2] and [t.tolist() for t in sched["ws"]] == [[1.0, 1.0], [0.0]]
    assert "model.0.weight" in snap.get_state_dict_for_key("dcp")  # DCP's flat keys, as before
    with pytest.raises(
        KeyNotFoundError,
        match=r"has no app_state key 'optim' \(it has \['model', 'sched', 'step'\]\)",
    ):
        snap.get_state_dict_for_key("optim")
    store.close()


def test_unknown_key_is_a_key_error(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True)
    snap = store.take({"model": torch.nn.Linear(2, 2)}, run="r", step=1)
    with pytest.raises(KeyError, match="has no app_state key 'optim'"):
        ckstore.Snapshot.of(snap).get_state_dict_for_key("optim")
    store.close()
