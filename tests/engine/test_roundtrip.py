"""Bit-exact round trips across dtypes, shapes and layouts, in one process and across processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import ckstore
from tests.support.paths import REPO
from tests.support.states import bits, dtype_matrix

ROOT = REPO


def _assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


def test_every_dtype_and_shape_round_trips_bit_exactly(store):
    state = dtype_matrix()
    store.take({"t": ckstore.StateDict(state)}, run="r", step=1)
    dest = ckstore.StateDict({k: torch.empty_like(v) for k, v in state.items()})
    store.get("r@1").restore({"t": dest})
    _assert_same(state, dict(dest))
    for key, value in state.items():
        assert bits(store.get("r").read_object(f"t/{key}")) == bits(value), key


def test_restore_into_empty_statedict_rebuilds_every_value(store):
    state = {
        "tensors": dtype_matrix(1),
        "step": 10,
        "lr": 1e-3,
        "name": "x",
        "nothing": None,
        "blob": b"\x00\x01",
        "nested": {"a": [1, (2, 3)], 4: {"deep": torch.ones(3)}},
        "array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "np_scalar": np.float64(2.5),
    }
    store.take({"s": ckstore.StateDict(state)}, run="r")
    out = ckstore.StateDict()
    store.get("r").restore({"s": out})
    _assert_same(state["tensors"], out["tensors"])
    assert out["step"] == 10 and out["lr"] == 1e-3 and out["name"] == "x" and out["nothing"] is None
    assert out["blob"] == b"\x00\x01" and out["nested"]["a"] == [1, (2, 3)]
    assert torch.equal(out["nested"][4]["deep"], torch.ones(3))
    assert isinstance(out["array"], np.ndarray) and (out["array"] == state["array"]).all()
    assert out["np_scalar"] == 2.5 and isinstance(out["np_scalar"], np.float64)


def test_restore_into_existing_tensors_is_in_place(store):
    model = torch.nn.Linear(50, 40)
    store.take({"m": model}, run="r")
    other = torch.nn.Linear(50, 40)
    weight = other.weight
    ptr = weight.data_ptr()
    store.get("r").restore({"m": other})
    assert other.weight is weight and weight.data_ptr() == ptr
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_restore_into_a_fresh_optimizer_with_empty_state(store):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.Linear(30, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(3):
        model(torch.randn(4, 30)).sum().backward()
        opt.step()
        sched.step()
    store.take({"model": model, "optim": opt, "sched": sched}, run="r")

    model2 = torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.Linear(30, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2)
    store.get("r").restore({"model": model2, "optim": opt2, "sched": sched2})
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    assert sched.state_dict() == sched2.state_dict()


def test_rng_state_round_trips(store):
    import random

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    store.take({"rng": ckstore.RNGState()}, run="r")
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    store.get("r").restore({"rng": ckstore.RNGState()})
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


_CHILD = textwrap.dedent(
    """
    import sys, torch, ckstore
    sys.path.insert(0, {root!r})
    from tests.support.states import dtype_matrix, bits
    store = ckstore.open({path!r}, create=True)
    if sys.argv[1] == "take":
        store.take({{"t": ckstore.StateDict(dtype_matrix(7))}}, run="x", step=1)
    else:
        got = store.get("x").read_object("t")
        want = dtype_matrix(7)
        assert all(bits(got[k]) == bits(want[k]) and got[k].dtype == want[k].dtype for k in want)
        print("OK", len(want))
    """
)


def test_round_trip_across_processes(tmp_path):
    path = str(tmp_path / "shared")
    code = _CHILD.format(root=str(ROOT), path=path)
    subprocess.run([sys.executable, "-c", code, "take"], check=True, timeout=120)
    # read in this process...
    got = ckstore.open(path, create=True).get("x").read_object("t")
    want = dtype_matrix(7)
    assert all(bits(got[k]) == bits(want[k]) for k in want)
    # ...and in yet another one
    out = subprocess.run(
        [sys.executable, "-c", code, "read"],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert out.stdout.startswith("OK")


class _Attributed(dict):
    """A dict subclass carrying ``_metadata``, as some trainers' state dicts do."""


@pytest.mark.parametrize("how", ["take", "async_take"])
def test_a_dict_subclass_with_metadata_is_read_back_with_it(store, how):
    """A plain dict cannot hold ``_metadata``: a snapshot of a dict subclass that carried it
    was committed but could not be read back (``AttributeError``); it reads back as an
    OrderedDict holding the metadata, as a module's state dict does."""
    inner = _Attributed(w=torch.arange(6.0), lr=0.5)
    inner._metadata = {"": {"version": 2}}
    take = getattr(store, how)
    result = take({"s": ckstore.StateDict(net=inner)}, run="meta")
    snap = result.wait(timeout=60) if how == "async_take" else result
    got = snap.read_object("s")["net"]
    assert torch.equal(got["w"], inner["w"]) and got["lr"] == 0.5
    assert got._metadata == {"": {"version": 2}}
