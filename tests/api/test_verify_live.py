"""``Snapshot.verify_live``: is the state in memory this snapshot's state? Live tensors are
hashed on the snapshot's chunk grid and compared with its chunk ids, nothing read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import CorruptionError
from ckstore.objects import CountingBackend
from tests.support.training import Trainer

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def test_names_every_key_that_differs(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    t = Trainer.make()
    t.train()
    extra = ckstore.StateDict(step=7, arr=torch.arange(10).numpy(), big=torch.randn(3000))
    app = {**t.app_state(), "extra": extra}
    snap = store.take(app, run="r", step=1)
    assert snap.verify_live(app).ok
    with torch.no_grad():
        t.model[3].weight[-1, -1] += 1e-7  # one element of the last chunk
    extra["step"] = 8
    extra["big"] = extra["big"].clone().to(torch.float64)  # another dtype
    extra["new"] = 1
    del extra["arr"]
    got = snap.verify_live(app)
    assert not got.ok
    assert got.differs == ["extra/big", "extra/step", "model/3.weight"]
    assert got.missing == ["extra/arr"] and got.extra == ["extra/new"]
    assert got.checked == len(snap.get_manifest()) - 1
    store.close()


def test_a_restored_tensor_corrupted_in_place_before_the_check_is_named(tmp_path: Path) -> None:
    """Issue 25, item 4: restore into a fresh model, damage one restored tensor in place (one
    bit of one element, as a bad copy or a stray kernel would), then check: named, and only it."""
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    t = Trainer.make()
    t.train()
    snap = store.take(t.app_state(), run="r", step=1)
    fresh = Trainer.make(seed=99)
    app = fresh.app_state()
    snap.restore(app)
    assert snap.verify_live(app).ok
    with torch.no_grad():
        w = fresh.model[0].weight
        w.view(torch.int32).view(-1)[w.numel() // 2] ^= 1  # the lowest mantissa bit
    got = snap.verify_live(app)
    assert not got.ok and got.differs == ["model/0.weight"] and not got.missing and not got.extra
    store.close()


def test_reads_nothing_from_the_store(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    app = {"m": ckstore.StateDict(w=torch.randn(5000))}
    snap = store.take(app, run="r")
    counting = CountingBackend(store.repository.objects.backend)
    store.repository.objects._backend = counting  # type: ignore[attr-defined]
    assert snap.verify_live(app).ok
    assert counting.get_calls == 0 and counting.list_calls == 0
    store.close()


class _Lossy(torch.nn.Module):
    """A module whose load_state_dict rounds its weight (a buggy loading hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(400))

    def load_state_dict(self, sd: Any, strict: bool = True, assign: bool = False) -> Any:
        out = super().load_state_dict(sd, strict, assign)
        with torch.no_grad():
            self.w.copy_(self.w.half().float())
        return out


def test_restore_verify_catches_what_load_state_dict_changed(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    snap = store.take({"m": _Lossy()}, run="r")
    fresh = _Lossy()
    snap.restore({"m": fresh})  # no check: silently rounded
    with pytest.raises(
        CorruptionError, match=r"1 key\(s\) of app_state do not hold the snapshot's state: m/w"
    ):
        snap.restore({"m": _Lossy()}, verify=True)
    plain = torch.nn.Linear(20, 20)
    store.take({"m": plain}, run="p").restore({"m": torch.nn.Linear(20, 20)}, verify=True)  # fine
    store.close()


def test_dcp_snapshot_verifies_through_its_keys(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    model = torch.nn.Linear(40, 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": model.state_dict()},
            storage_writer=StorageWriter(store, run="d", step=1),
            no_dist=True,
        )
    snap = store.get("d")
    assert snap.verify_live({"model": model}).ok
    with torch.no_grad():
        model.bias[0] = 5.0
    assert snap.verify_live({"model": model}).differs == ["model/bias"]
    store.close()
