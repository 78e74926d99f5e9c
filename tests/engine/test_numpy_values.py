"""NumPy arrays keep what makes them what they are: a 0-d array (``np.array(3.5)``) comes back
0-d (it was stored with shape (1,)), and a masked array, whose mask the format cannot hold, is
refused with UnsupportedValueError naming the key (it was stored as its raw data, the masked
elements restored as valid values)."""

from __future__ import annotations

import numpy as np
import pytest

import ckstore
from ckstore import errors


def test_zero_dim_numpy_array_keeps_its_shape(store):
    value = np.array(3.5, dtype=np.float32)  # shape ()
    store.take({"s": ckstore.StateDict(x=value)}, run="r", step=1)

    assert store.get("r@1").get_manifest()["s/x"].shape == ()

    out = ckstore.StateDict()
    store.get("r@1").restore({"s": out})
    assert isinstance(out["x"], np.ndarray)
    assert out["x"].shape == (), out["x"]  # got array([3.5], dtype=float32), shape (1,)

    read = store.get("r@1").read_object("s/x")
    assert read.shape == (), read


def test_a_masked_array_is_refused_not_stored_without_its_mask(store):
    value = np.ma.array([1.0, -999.0, 3.0], mask=[False, True, False])
    assert value.mean() == 2.0
    with pytest.raises(errors.UnsupportedValueError, match="'s/x'.*mask"):
        store.take({"s": ckstore.StateDict(x=value)}, run="r", step=1)
    with pytest.raises(errors.UnsupportedValueError, match="'s/x'.*mask"):
        store.async_take({"s": ckstore.StateDict(x=value)}, run="r", step=1).wait(60)
    assert store.get("r", None) is None
