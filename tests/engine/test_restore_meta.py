"""A restore into a model built under ``torch.device("meta")`` materialises it, or says why not.

Before: the restore copied into the meta tensors (a no-op), called ``load_state_dict`` with
them and returned normally with nothing loaded, not even the warning ``load_state_dict`` gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import MismatchError


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.BatchNorm1d(30))


def _trained() -> torch.nn.Module:
    torch.manual_seed(0)
    net = _net()
    net(torch.randn(8, 40))  # BatchNorm's running statistics move off their defaults
    return net


def _assert_loaded(dest: torch.nn.Module, src: torch.nn.Module) -> None:
    got, want = dest.state_dict(), src.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert got[k].device.type == "cpu", k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("atomic", [True, False])
def test_a_model_built_on_meta_is_materialised_on_the_cpu(store, atomic):
    src = _trained()
    store.take({"model": src}, run="r", step=1)
    with torch.device("meta"):
        dest = _net()
    store.get("r").restore({"model": dest}, atomic=atomic)
    _assert_loaded(dest, src)
    weight = dest[0].weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert dest[1].running_mean.requires_grad is False
    dest(torch.randn(4, 40))  # usable as it is


def test_only_the_meta_part_of_a_model_is_assigned(store):
    src = _trained()
    store.take({"model": src}, run="r", step=1)
    dest = _net()
    dest[0].to_empty(device="meta")  # the first layer on meta, the norm on the CPU
    kept = dest[1].weight
    store.get("r").restore({"model": dest})
    _assert_loaded(dest, src)
    assert dest[1].weight is kept  # a tensor with storage is still loaded in place


def test_a_statedict_of_meta_tensors_gets_the_stored_tensors(store):
    store.take({"s": ckstore.StateDict(w=torch.arange(300.0), b=torch.ones(3))}, run="r", step=1)
    dest = ckstore.StateDict(w=torch.empty(300, device="meta"), b=torch.zeros(3))
    store.get("r").restore({"s": dest})
    assert torch.equal(dest["w"], torch.arange(300.0)) and torch.equal(dest["b"], torch.ones(3))


def test_a_meta_tensor_of_another_shape_is_still_a_mismatch(store):
    store.take({"s": ckstore.StateDict(w=torch.arange(300.0))}, run="r", step=1)
    with pytest.raises(MismatchError, match="'s/w'"):
        store.get("r").restore({"s": ckstore.StateDict(w=torch.empty(7, device="meta"))})


class _InPlace:
    """A stateful that copies into the tensors it holds (so it cannot take new ones)."""

    def __init__(self) -> None:
        self.w = torch.empty(300, device="meta")

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w.copy_(state["w"])


def test_a_stateful_that_stays_on_meta_is_a_mismatch_naming_its_keys(store):
    store.take({"s": ckstore.StateDict(w=torch.arange(300.0))}, run="r", step=1)
    with pytest.raises(MismatchError, match=r"meta.*'s/w'"):
        store.get("r").restore({"s": _InPlace()})


def test_an_optimizer_over_meta_parameters_is_refused_before_anything_loads(store):
    src = _trained()
    opt = torch.optim.Adam(src.parameters())
    src(torch.randn(8, 40)).sum().backward()
    opt.step()
    store.take({"model": src, "opt": opt}, run="r", step=1)
    with torch.device("meta"):
        dest = _net()
    dest_opt = torch.optim.Adam(dest.parameters())
    with pytest.raises(MismatchError, match=r"app_state\['opt'\].*meta"):
        store.get("r").restore({"model": dest, "opt": dest_opt})
    assert dest[0].weight.is_meta  # refused before anything was loaded
    # the order that works: the model first, then its optimizer over the real parameters
    store.get("r").restore({"model": dest})
    dest_opt = torch.optim.Adam(dest.parameters())
    store.get("r").restore({"opt": dest_opt}, strict=False)
    assert torch.equal(
        dest_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
