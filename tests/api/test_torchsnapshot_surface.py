"""TorchSnapshot's public surface, behaviour for behaviour, in one process.

Written from TorchSnapshot's documentation and public API: logical paths ``<rank>/<key>``,
RNGState captured first and restored last, TypeError for values that are not stateful, lazy
``Snapshot(path)``, ``get_state_dict_for_key``, ``fs://`` paths, primitive values, a state
whose structure differs from the destination's.
"""

from __future__ import annotations

import io
import os
import random

import numpy as np
import pytest
import torch

import ckstore
from ckstore import RNGState, Snapshot, StateDict
from ckstore.errors import KeyNotFoundError, UnsupportedValueError
from tests.support.states import DrawsRandomNumbers


def _draws() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(4), random.random(), np.random.rand(4)


def test_rng_state_is_captured_first_and_restored_last(tmp_path):
    app = {"effectful": DrawsRandomNumbers(), "rng": RNGState(), "more": DrawsRandomNumbers()}
    snap = Snapshot.take(path=str(tmp_path / "s"), app_state=app)
    after_take = _draws()
    snap.restore(app)  # the others draw while loading; the generators are set after them
    after_restore = _draws()
    assert torch.equal(after_take[0], after_restore[0])
    assert after_take[1] == after_restore[1] and np.array_equal(after_take[2], after_restore[2])
    # the same through the store API, and with a fresh handle in "another process"
    store = ckstore.open(tmp_path / "store", create=True)
    store.take(app, run="r")
    expected = _draws()
    Snapshot(path=str(tmp_path / "s")).restore(app)
    assert torch.equal(_draws()[0], after_take[0])
    store.get("r").restore(app)
    assert torch.equal(_draws()[0], expected[0])


def test_logical_paths_are_rank_prefixed_on_path_snapshots(tmp_path):
    state = StateDict(foo=42, bar=torch.randn(20, 20), nested={"a": torch.arange(5.0), "b": "x"})
    snap = Snapshot.take(path=str(tmp_path / "s"), app_state={"state": state})
    assert snap.ranked_paths
    assert set(snap.get_manifest()) == {
        "0/state/foo",
        "0/state/bar",
        "0/state/nested/a",
        "0/state/nested/b",
    }
    assert snap.read_object("0/state/foo") == 42
    assert snap.read_object("0/state/foo", 777) == 42  # obj_out ignored for values
    baz = torch.randn(20, 20)
    assert snap.read_object("0/state/bar", baz) is baz and torch.equal(baz, state["bar"])
    assert snap.read_object("0/state/nested")["b"] == "x"  # a container path reads the subtree
    assert (
        snap.read_object("3/state/foo") == 42
    )  # shared entries serve any rank, as replicated ones do
    with pytest.raises(KeyNotFoundError, match="start with the rank"):
        snap.read_object("state/foo")
    with pytest.raises(KeyNotFoundError, match="did you mean"):
        snap.read_object("0/state/fo")
    # the store API keeps plain keys for the same snapshot
    plain = ckstore.open(tmp_path / "s", create=True).get(snap.id)
    assert not plain.ranked_paths and "state/foo" in plain.get_manifest()
    assert plain.read_object("state/foo") == 42
    assert snap.with_ranked_paths(False).get_manifest().keys() == plain.get_manifest().keys()


def test_values_without_state_dict_raise_type_error(tmp_path):
    with pytest.raises(TypeError, match="'optim'"):
        Snapshot.take(path=str(tmp_path / "s"), app_state={"optim": 1})
    assert not (tmp_path / "s").exists()  # refused before anything was created
    with pytest.raises(UnsupportedValueError):
        ckstore.open(tmp_path / "store", create=True).take({"x": object()})
    lazy = Snapshot(path=str(tmp_path / "s"))  # nothing there: the type is checked first
    with pytest.raises(TypeError):
        lazy.restore(app_state={"optim": 1})


def test_lazy_handle_and_get_state_dict_for_key(tmp_path):
    path = str(tmp_path / "s")
    handle = Snapshot(path)  # made before the take, as TorchSnapshot allows
    model = torch.nn.Linear(6, 3)
    handle.take(path, app_state={"model": model, "gen": StateDict(foo=2, bar="baz")})
    assert handle.get_state_dict_for_key("gen") == {"foo": 2, "bar": "baz"}
    sd = Snapshot(path).get_state_dict_for_key("model")
    assert torch.equal(sd["weight"], model.weight) and list(sd) == ["weight", "bias"]
    with pytest.raises(KeyNotFoundError, match="invalid_key"):
        handle.get_state_dict_for_key("invalid_key")


def test_fs_paths_are_local_paths(tmp_path, monkeypatch):
    state = StateDict(w=torch.arange(12.0))
    Snapshot.take(path=f"fs://{tmp_path}/abs", app_state={"s": state})
    assert (tmp_path / "abs" / "ckstore.json").exists()
    assert torch.equal(Snapshot(str(tmp_path / "abs")).read_object("0/s/w"), state["w"])
    monkeypatch.chdir(tmp_path)
    Snapshot.take(path="fs://rel/step_1", app_state={"s": state})
    assert (tmp_path / "rel" / "ckstore.json").exists()  # a step-like path: the store is its parent
    dest = StateDict(w=torch.zeros(12))
    Snapshot(path="fs://rel/step_1").restore({"s": dest})
    assert torch.equal(dest["w"], state["w"])
    assert os.path.isdir(tmp_path / "rel")


def test_primitive_values_bytesio_and_other_structures(tmp_path):
    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    state = StateDict(
        int_key=100,
        float_key=3.14,
        str_key="s",
        bool_key=True,
        bytes_key=b"\x00\x10",
        losses=losses,
    )
    snap = Snapshot.take(path=str(tmp_path / "s"), app_state={"key": state})
    dest = StateDict(
        int_key=None, float_key=None, str_key=None, bool_key=None, bytes_key=None, losses=None
    )
    snap.restore({"key": dest})
    back = dest.pop("losses")
    assert isinstance(back, io.BytesIO) and back.tell() == 0
    assert torch.load(back, weights_only=True) == [0.5, 0.25]
    assert dest == {k: v for k, v in state.items() if k != "losses"}

    class ListState:  # the destination starts empty; the snapshot's structure is rebuilt
        def __init__(self) -> None:
            self.objs: list = []

        def state_dict(self) -> dict:
            return {"objs": self.objs}

        def load_state_dict(self, sd: dict) -> None:
            self.objs = sd["objs"]

    src = ListState()
    src.objs = [torch.rand(8, 8) for _ in range(3)] + [[torch.rand(4) for _ in range(2)]]
    dst = ListState()
    Snapshot.take(path=str(tmp_path / "l"), app_state={"state": src}).restore({"state": dst})
    assert torch.equal(dst.objs[0], src.objs[0]) and torch.equal(dst.objs[3][1], src.objs[3][1])


def test_strict_false_loads_a_module_with_more_layers(tmp_path):
    foo = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    bar = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 1))
    snap = Snapshot.take(path=str(tmp_path / "s"), app_state={"foo": foo})
    with pytest.raises(ckstore.MismatchError):
        snap.restore({"foo": bar})
    snap.restore({"foo": bar}, strict=False)
    assert torch.equal(bar[0].weight, foo[0].weight)
