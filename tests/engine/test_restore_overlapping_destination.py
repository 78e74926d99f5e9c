"""A destination whose elements share memory (an ``expand``-ed view) is refused with
MismatchError naming the key before anything is written, so an atomic restore leaves the
app_state untouched. Before, validation let it through: the restore wrote the other keys,
then torch's ``copy_`` raised a plain RuntimeError on it."""

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
