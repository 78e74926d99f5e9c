"""A destination whose elements share memory (an ``expand``-ed or ``as_strided`` view) is
refused with MismatchError naming the key before anything is written, so an atomic restore
leaves the app_state untouched; so is such an ``obj_out`` of ``read_object``, and one on the
meta device. Before, validation let them through: the restore wrote the other keys, then
torch's ``copy_`` raised a plain RuntimeError on an expanded view, wrote an ``as_strided`` one
with no error (wrong values), and ``read_object`` handed a meta ``obj_out`` back unloaded.
A destination that is never written (a meta module's expanded buffer, replaced; one with no
elements) is not refused."""

from __future__ import annotations

import pytest
import torch

import ckstore


def test_failed_atomic_restore_leaves_destination_untouched(store):
    store.take(
        {"m": ckstore.StateDict(a=torch.ones(40, 30), z=torch.arange(500.0))}, run="r", step=1
    )

    a = torch.zeros(40, 30)
    z = torch.zeros(1).expand(500)  # stride 0: cannot hold 500 distinct values
    for atomic in (True, False):
        with pytest.raises(ckstore.errors.MismatchError, match="'m/z'.*expanded"):
            store.get("r@1").restore({"m": ckstore.StateDict(a=a, z=z)}, atomic=atomic)
        assert a.sum().item() == 0.0, "the restore wrote 'a' before it failed"
    with pytest.raises(ckstore.errors.MismatchError, match="expanded"):
        store.get("r@1").restore(
            {"m": ckstore.StateDict(a=a, z=torch.zeros(1, dtype=torch.float64).expand(500))},
            cast=True,
        )
    assert a.sum().item() == 0.0


STORED = torch.arange(400.0).reshape(20, 20)


@pytest.mark.parametrize("atomic", [True, False])
def test_an_overlapping_strided_destination_is_refused_before_anything_is_written(
    store: ckstore.Store, atomic: bool
) -> None:
    store.take({"m": ckstore.StateDict(a=torch.ones(40, 30), z=STORED)}, run="r", step=1)
    a = torch.zeros(40, 30)
    z = torch.zeros(40).as_strided((20, 20), (1, 1))  # windows: elements share memory
    with pytest.raises(ckstore.errors.MismatchError, match="'m/z'.*share memory"):
        store.get("r@1").restore({"m": ckstore.StateDict(a=a, z=z)}, atomic=atomic)
    assert a.sum().item() == 0.0


def test_read_object_refuses_an_overlapping_or_meta_obj_out(store: ckstore.Store) -> None:
    store.take({"m": ckstore.StateDict(z=STORED)}, run="r", step=1)
    snap = store.get("r@1")
    with pytest.raises(ckstore.errors.MismatchError, match="meta device"):
        snap.read_object("m/z", obj_out=torch.empty(20, 20, device="meta"))
    with pytest.raises(ckstore.errors.MismatchError, match="share memory"):
        snap.read_object("m/z", obj_out=torch.zeros(40).as_strided((20, 20), (1, 1)))
    out = torch.zeros(20, 20).t()  # transposed: its own memory, laid out otherwise
    assert torch.equal(snap.read_object("m/z", obj_out=out), STORED)


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(1).expand(8))  # persistent, stride 0


@pytest.mark.parametrize("atomic", [True, False])
def test_a_meta_models_expanded_buffer_is_replaced_not_refused(
    store: ckstore.Store, atomic: bool
) -> None:
    src = _Masked()
    src.mask = torch.arange(8.0)
    store.take({"model": src}, run="r", step=1)
    with torch.device("meta"):
        model = _Masked()
    store.get("r@1").restore({"model": model}, atomic=atomic)
    assert model.mask.tolist() == list(range(8)) and not model.lin.weight.is_meta


def test_an_expanded_destination_without_elements_restores(store: ckstore.Store) -> None:
    store.take({"m": ckstore.StateDict(e=torch.zeros(3, 0), a=torch.ones(4))}, run="r", step=2)
    a = torch.zeros(4)
    store.get("r@2").restore({"m": ckstore.StateDict(e=torch.zeros(1, 0).expand(3, 0), a=a)})
    assert a.tolist() == [1.0] * 4
