"""Damaged bytes, wrong keys, wrong shapes: a typed error, and the caller's state untouched."""

from __future__ import annotations

import builtins
import copy
import pickle
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import objects
from tests.support.states import flip_byte_of


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 10))


def _same(a: torch.nn.Module, b_state: dict) -> bool:
    return all(torch.equal(v, b_state[k]) for k, v in a.state_dict().items())


def test_flipped_byte_raises_corruption_naming_the_key_and_leaves_state_untouched(store):
    snap = store.take({"m": _model()}, run="r")
    flip_byte_of(store, snap, "m/0.weight")
    dest = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 10))
    before = copy.deepcopy(dest.state_dict())
    with pytest.raises(ckstore.CorruptionError, match="'m/0.weight'"):
        store.get("r").restore({"m": dest})
    assert _same(dest, before)
    with pytest.raises(ckstore.CorruptionError):
        store.get("r").read_object("m/0.weight")
    # an undamaged tensor of the same snapshot still reads
    assert torch.equal(store.get("r").read_object("m/1.weight"), _model()[1].weight)


def test_corrupt_manifest_is_detected(store):
    snap = store.take({"m": _model()}, run="r")
    path = Path(store.url) / objects.blob_name("manifests", snap.record.manifest_id)
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(ckstore.CorruptionError):
        store.get("r").get_manifest()


@pytest.mark.parametrize(
    "dest,match",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(40, 41), torch.nn.Linear(41, 10)),
            "'m/0.weight'.*shape|torch.float32 \\[40, 40\\]",
        ),
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 10)).double(),
            "float64",
        ),
        (lambda: torch.nn.Sequential(torch.nn.Linear(40, 40)), "not in the destination"),
        (
            lambda: torch.nn.Sequential(
                torch.nn.Linear(40, 40), torch.nn.Linear(40, 10), torch.nn.Linear(10, 2)
            ),
            "missing from the snapshot",
        ),
    ],
)
def test_mismatched_destination_raises_before_mutating(store, dest, match):
    store.take({"m": _model(), "other": torch.nn.Linear(3, 3)}, run="r")
    d = dest()
    other = torch.nn.Linear(3, 3)
    before = copy.deepcopy(d.state_dict()), copy.deepcopy(other.state_dict())
    with pytest.raises(ckstore.MismatchError, match=match):
        store.get("r").restore({"other": other, "m": d})
    assert _same(d, before[0]) and _same(other, before[1])


def test_missing_app_key_and_unknown_object_key(store):
    store.take({"m": _model()}, run="r")
    with pytest.raises(ckstore.MismatchError, match="no app_state key 'x'"):
        store.get("r").restore({"x": torch.nn.Linear(1, 1)})
    store.get("r").restore({"x": torch.nn.Linear(1, 1)}, strict=False)  # skipped
    with pytest.raises(ckstore.KeyNotFoundError, match="did you mean"):
        store.get("r").read_object("m/0.weigth")
    with pytest.raises(KeyError):  # also a builtin KeyError
        store.get("r").read_object("nope")


def test_unstorable_values_are_refused_with_the_key(store):
    with pytest.raises(ckstore.UnsupportedValueError, match="'s/fn'"):
        store.take({"s": ckstore.StateDict(fn=print)}, run="r")
    with pytest.raises(ckstore.InvalidInputError, match="StateDict"):
        store.take({"s": {"plain": 1}}, run="r")
    with pytest.raises(ckstore.InvalidInputError, match="JSON"):
        store.take({"s": ckstore.StateDict(a=1)}, run="r", metadata={"x": object()})
    assert store.log() == []  # nothing half-written became visible


def test_unknown_ref_is_a_typed_error(store):
    with pytest.raises(ckstore.SnapshotNotFoundError):
        store.get("nope")
    store.take({"m": _model()}, run="r", step=1)
    with pytest.raises(ckstore.SnapshotNotFoundError):
        store.get("r@2")


def test_read_path_never_unpickles(store, monkeypatch):
    state = {"m": _model(), "s": ckstore.StateDict(step=1, rng=ckstore.RNGState().state_dict())}
    store.take(state, run="r")

    def forbidden(*a, **k):
        raise AssertionError("the read path must not unpickle")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    real_import = builtins.__import__

    def guarded_import(name, *a, **k):
        if name in ("dill", "cloudpickle"):
            raise AssertionError(f"the read path imported {name}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guarded_import)
    fresh = ckstore.open(store.url, create=True)
    dest = {
        "m": torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 10)),
        "s": ckstore.StateDict(),
    }
    fresh.get("r").restore(dest)
    fresh.get("r").read_object("m/0.weight")
    fresh.get("r").get_manifest()
    assert _same(dest["m"], _model().state_dict())


def test_sharded_tensor_is_refused_with_advice(store):
    class ShardedTensor(torch.Tensor):  # stands in for torch's deprecated class of that name
        pass

    t = torch.zeros(4).as_subclass(ShardedTensor)
    with pytest.raises(ckstore.UnsupportedValueError, match="'s/w'.*DTensor"):
        store.take({"s": ckstore.StateDict(w=t)}, run="r")
