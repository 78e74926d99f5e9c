"""Odd tensors and destinations come back as stored, or are refused by name before anything
of the caller's changes.

Before: a plain value stored where the module now has a tensor, and a cast to or from the
packed ``float4_e2m1fn_x2``, passed the checks and failed with torch's untyped error after
other keys were loaded; a transposed fp4 tensor could not be taken; a contiguous conjugate or
negative-bit destination failed with torch's error; a NumPy ``longdouble`` array failed with a
``TypeError`` naming no key; tied weights of a model built on the meta device came back as two
tensors, which the first optimizer step made differ. After review: extra state stored as a
value was refused where the module now returns a tensor; a ``Counter`` (MultiStepLR's
milestones) came back a ``dict``; keys that differ by DataParallel's ``module.`` were told to
pass ``strict=False``, which loads nothing. After the second review: ``read_object`` (and a
pointer file) rebuilt a Counter from its pairs, scrambling it; a snapshot ``dcp.save`` wrote
still gave a ``dict``; the prefix hints misfired on a model that only gained or lost a key.
Later: a wrapper tensor subclass as the destination of a key stored in chunks failed with
torch's error.
"""

from __future__ import annotations

import collections
import io
import warnings

import numpy as np
import pytest
import torch

import ckstore
from ckstore.errors import MismatchError, UnsupportedValueError
from tests.support.deltas import App

ROWS = 3000  # a tensor stored in chunks, not in the manifest


def _fp4(rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (rows * cols,), dtype=torch.uint8, generator=g)
    return raw.view(torch.float4_e2m1fn_x2).reshape(rows, cols)


def test_a_value_where_the_module_has_a_tensor_is_a_mismatch_and_touches_nothing(store):
    torch.manual_seed(0)
    sd: dict[str, object] = dict(torch.nn.Linear(3, 3).state_dict())
    sd["bias"] = 1.5  # a buffer that was a Python float in the code that took it
    snap = store.take({"a": ckstore.StateDict(v=torch.ones(2)), "model": App(sd)}, run="r")
    dest_a = ckstore.StateDict(v=torch.zeros(2))
    model = torch.nn.Linear(3, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MismatchError, match="model/bias"):
        snap.restore({"a": dest_a, "model": model})
    assert torch.equal(dest_a["v"], torch.zeros(2))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("direction", ["to_fp4", "from_fp4"])
def test_a_cast_to_or_from_packed_fp4_is_refused_before_anything_loads(store, direction):
    if direction == "to_fp4":
        stored, dest = torch.randn(ROWS, 4), torch.empty(ROWS, 4, dtype=torch.float4_e2m1fn_x2)
    else:
        stored, dest = _fp4(ROWS, 4), torch.zeros(ROWS, 4)
    app = {"a": ckstore.StateDict(v=torch.ones(ROWS)), "m": ckstore.StateDict(x=stored)}
    snap = store.take(app, run="r", on_nonfinite="ignore")
    a = ckstore.StateDict(v=torch.zeros(ROWS))
    with pytest.raises(MismatchError, match="m/x"):
        snap.restore({"a": a, "m": ckstore.StateDict(x=dest)}, cast=True)
    assert torch.equal(a["v"], torch.zeros(ROWS))


@pytest.mark.parametrize("take", ["take", "async_take"])
def test_a_transposed_fp4_tensor_round_trips(store, take):
    t = _fp4(ROWS, 5).t()
    snap = getattr(store, take)({"m": ckstore.StateDict(x=t)}, run="r", on_nonfinite="ignore")
    back = (snap.wait() if take == "async_take" else snap).read_object("m/x")
    assert back.dtype == torch.float4_e2m1fn_x2 and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8).contiguous())


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_conjugate_or_negative_view_destination_gets_the_stored_values(store, atomic, bit):
    g = torch.Generator().manual_seed(1)
    if bit == "conj":
        src = torch.randn(ROWS, 3, dtype=torch.complex64, generator=g)
        dest = torch.zeros(ROWS, 3, dtype=torch.complex64).conj()
    else:
        src = torch.randn(ROWS, 3, generator=g)
        dest = torch.zeros(ROWS, 3)._neg_view()
    assert dest.is_contiguous() and (dest.is_conj() or dest.is_neg())
    snap = store.take({"m": ckstore.StateDict(x=src)}, run="r")
    sd = ckstore.StateDict(x=dest)
    snap.restore({"m": sd}, atomic=atomic)
    assert torch.equal(sd["x"], src)  # what copy_ into that view would give


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
def test_a_numpy_long_double_array_is_refused_by_name(store, dtype):
    if np.dtype(dtype).itemsize <= (16 if np.dtype(dtype).kind == "c" else 8):
        pytest.skip("long double is a double on this platform")
    arr = np.arange(3, dtype=dtype)
    with pytest.raises(UnsupportedValueError, match="m/arr"):
        store.take({"m": ckstore.StateDict(arr=arr)}, run="r")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("atomic", [True, False])
def test_tied_weights_of_a_model_built_on_meta_stay_tied(store, atomic):
    torch.manual_seed(0)
    model = _Tied()
    snap = store.take({"model": model}, run="r")
    with torch.device("meta"):
        fresh = _Tied()
    snap.restore({"model": fresh}, atomic=atomic)
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    # one storage, as load_state_dict(assign=True) of torch.load's state dict leaves them
    assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()


class _WithExtra(torch.nn.Module):
    """A module whose extra state was a ``BytesIO`` and is a tensor in newer code."""

    def __init__(self, as_tensor: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.as_tensor = as_tensor
        self.got: object = None

    def get_extra_state(self) -> object:
        if self.as_tensor:
            return torch.tensor([1, 2, 3], dtype=torch.uint8)
        return io.BytesIO(b"fp8-meta")

    def set_extra_state(self, state: object) -> None:
        self.got = state


def test_extra_state_stored_as_a_value_restores_into_tensor_extra_state(store):
    """``load_state_dict`` hands any value to ``set_extra_state``; so does a restore."""
    old = _WithExtra(as_tensor=False)
    snap = store.take({"m": old}, run="r")
    new = _WithExtra(as_tensor=True)
    snap.restore({"m": new})
    assert isinstance(new.got, io.BytesIO) and new.got.getvalue() == b"fp8-meta"
    assert torch.equal(new.lin.weight, old.lin.weight)


def _multistep() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.MultiStepLR]:
    torch.manual_seed(0)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return opt, torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], 0.5)


def test_multisteplr_keeps_its_counter_and_steps_on(store):
    """MultiStepLR's milestones are a Counter, whose ``elements()`` its closed form calls."""
    opt, sched = _multistep()
    opt.step()
    sched.step()
    snap = store.take({"opt": opt, "sched": sched}, run="r")
    opt2, sched2 = _multistep()
    store.get(snap.id).restore({"opt": opt2, "sched": sched2})
    assert type(sched2.milestones) is collections.Counter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step(epoch) is deprecated, still supported
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step(3)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_a_counter_value_comes_back_a_counter(store_path):
    with ckstore.open(store_path, create=True) as store:
        snap = store.take({"x": ckstore.StateDict(c=collections.Counter(a=2, b=1))}, run="r")
    with ckstore.open(store_path) as store:
        out = ckstore.StateDict()
        store.get(snap.id).restore({"x": out})
    assert type(out["c"]) is collections.Counter and out["c"] == {"a": 2, "b": 1}


def _seq() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("taken_wrapped", [True, False])
def test_a_dataparallel_prefix_gets_a_hint_that_loads(store, taken_wrapped):
    """Keys that differ by DataParallel's ``module.`` get the fix, not ``strict=False`` (which
    would load nothing)."""
    torch.manual_seed(0)
    plain = _seq()
    taken = torch.nn.DataParallel(plain) if taken_wrapped else plain
    snap = store.take({"model": taken}, run="r")
    dest = _seq() if taken_wrapped else torch.nn.DataParallel(_seq())
    with pytest.raises(MismatchError, match="module") as err:
        snap.restore({"model": dest})
    assert "strict=False to load what matches" not in str(err.value)
    fixed = torch.nn.DataParallel(dest) if taken_wrapped else dest.module  # what it says
    snap.restore({"model": fixed})
    inner = dest if taken_wrapped else dest.module
    assert torch.equal(inner[0].weight, plain[0].weight)


def _lr_sched(milestones: list[int]) -> torch.optim.lr_scheduler.MultiStepLR:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    return torch.optim.lr_scheduler.MultiStepLR(opt, milestones, 0.5)


def test_read_object_of_a_counter_keeps_its_counts(store):
    """Rebuilding a Counter from (key, value) pairs counts the pairs: every path that rebuilds
    a dict of the snapshot's (read_object's prune, a pointer file's values) fills it key by key."""
    counter = collections.Counter({"a": 2, "b": 1})
    snap = store.take({"s": _lr_sched([2, 4]), "c": ckstore.StateDict(c=counter)}, run="r")
    assert snap.read_object("s/milestones") == collections.Counter({2: 1, 4: 1})
    assert snap.read_object("s")["milestones"] == collections.Counter({2: 1, 4: 1})
    assert snap.read_object("c")["c"] == counter


def test_a_lightning_pointer_resumes_a_multisteplr_that_still_decays(store, tmp_path):
    from ckstore.integrations.lightning import CkstoreCheckpointIO

    cio = CkstoreCheckpointIO(store, run="lit")
    path = str(tmp_path / "a.ckpt")
    cio.save_checkpoint({"lr_schedulers": [_lr_sched([2, 4]).state_dict()], "global_step": 1}, path)
    sched = _lr_sched([2, 4])
    sched.load_state_dict(torch.load(path, weights_only=False)["lr_schedulers"][0])
    for _ in range(2):
        sched.optimizer.step()
        sched.step()
    assert sched.get_last_lr() == [0.5]  # decayed at epoch 2


def test_a_dcp_saved_multisteplr_restores_with_a_counter(store):
    import torch.distributed.checkpoint as dcp

    import ckstore.dcp

    model = torch.nn.Linear(2, 2)
    state = {"model": model.state_dict(), "sched": _lr_sched([2, 4]).state_dict()}
    dcp.save(state, storage_writer=ckstore.dcp.StorageWriter(store, run="sft", step=100))
    sched = _lr_sched([2, 4])
    store.get("sft@100").restore({"model": model, "sched": sched})
    assert type(sched.milestones) is collections.Counter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step(epoch) is deprecated, still supported
        sched.step(3)  # the closed form calls milestones.elements()


class _Holder(torch.nn.Module):
    """Not DataParallel: a module whose own submodule is named ``module``."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)
        if extra:
            self.module.register_buffer("scale", torch.ones(2))


@pytest.mark.parametrize("taken_extra", [False, True])
def test_a_key_more_or_less_under_module_is_not_called_dataparallel(store, taken_extra):
    snap = store.take({"model": _Holder(extra=taken_extra)}, run="r")
    with pytest.raises(MismatchError) as err:
        snap.restore({"model": _Holder(extra=not taken_extra)})
    assert "DataParallel" not in str(err.value)
    assert "strict=False to load what matches" in str(err.value)


def test_a_compiled_model_that_gained_a_key_is_not_told_to_use_orig_mod(store):
    torch.manual_seed(0)
    snap = store.take({"model": torch.compile(torch.nn.Linear(2, 2))}, run="r")
    grown = torch.nn.Linear(2, 2)
    grown.register_buffer("scale", torch.ones(2))
    with pytest.raises(MismatchError) as err:
        snap.restore({"model": torch.compile(grown)})
    assert "_orig_mod (the module it wraps" not in str(err.value)
    assert "strict=False to load what matches" in str(err.value)


class _InPlace:
    """A Stateful that keeps its tensors and is filled in place (``load_state_dict`` keeps
    nothing it is given)."""

    def __init__(self, d: dict[str, torch.Tensor]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.d

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        pass


@pytest.mark.parametrize("rows", [5, ROWS], ids=["inline", "in chunks"])
def test_a_tensor_subclass_destination_gets_the_values_through_copy(store, rows):
    """A wrapper tensor subclass's values are not its storage's bytes: it gets them through
    ``copy_``. Before (in review): an inline one failed with torch's error once the keys before
    it were written; one stored in chunks was refused with torch's error."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, t = torch.randn(4), torch.randn(rows)
    snap = store.take({"m": ckstore.StateDict(a=a.clone(), t=t.clone())}, run="r")
    app = _InPlace({"a": torch.zeros(4), "t": TwoTensor(torch.zeros(rows), torch.zeros(rows))})
    snap.restore({"m": app})
    assert torch.equal(app.d["a"], a)
    assert torch.equal(app.d["t"].a, t) and torch.equal(app.d["t"].b, t)
