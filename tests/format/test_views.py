"""The take's views of a tensor: its chunk cuts on the grid and its bytes, fast paths
checked against the general ones."""

from __future__ import annotations

import pytest
import torch

from ckstore.format.grid import cuts, make_grid
from ckstore.format.tensors import as_cpu_tensor, byte_view


@pytest.mark.parametrize(
    "shape, itemsize, chunk_bytes",
    [
        ((), 4, 64),
        ((0, 3), 4, 64),
        ((7,), 2, 4),
        ((5, 6), 4, 24),
        ((3, 4, 5), 8, 100),
        ((9, 1), 1, 3),
    ],
)
def test_the_cached_cuts_are_the_grid_and_its_byte_ranges(shape, itemsize, chunk_bytes):
    grid = make_grid(shape, itemsize, chunk_bytes)
    want = tuple((o, s, *grid.byte_range(o, s)) for o, s in grid.boxes())
    got_grid, got = cuts(shape, itemsize, chunk_bytes)
    assert got_grid == grid and got == want
    assert cuts(shape, itemsize, chunk_bytes)[1] is got  # asked again: from the cache


def _slow_view(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4),
        lambda: torch.tensor(2.5),  # zero dimensions
        lambda: torch.empty(0, 3),
        lambda: torch.arange(12).reshape(3, 4).t(),  # not contiguous: copied
        lambda: torch.randn(4, 6)[:, 1],
        lambda: torch.tensor([True, False, True]),
        lambda: torch.randn(2, 3, dtype=torch.complex64).conj(),  # a conjugate view
        lambda: torch.randn(3, dtype=torch.bfloat16),  # no NumPy twin
        lambda: torch.arange(5, dtype=torch.int16),
        lambda: torch.nn.Parameter(torch.randn(4, 2)),  # requires grad
    ],
)
def test_a_byte_view_holds_the_tensors_elements_in_c_order(make):
    t = make()
    view = byte_view(t)
    assert view.format == "B" and view.ndim == 1 and view.contiguous
    assert bytes(view) == _slow_view(t)
    assert bytes(byte_view(as_cpu_tensor(t, "k"))) == _slow_view(t)


def test_a_byte_view_of_a_contiguous_tensor_shares_its_memory():
    t = torch.zeros(4)
    view = byte_view(t)
    t[0] = 1.0
    assert bytes(view[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_cuts_of_many_blocks_are_not_kept_and_the_kept_ones_are_bounded(monkeypatch):
    from ckstore.format import grid

    monkeypatch.setattr(grid, "_CUTS", {})
    many = (grid.CUTS_CACHED_BLOCKS + 1, 4)
    assert len(cuts(many, 4, 16)[1]) == grid.CUTS_CACHED_BLOCKS + 1
    assert (many, 4, 16) not in grid._CUTS
    monkeypatch.setattr(grid, "CUTS_CACHED", 3)
    for rows in range(1, 6):
        cuts((rows, 4), 4, 16)
    assert list(grid._CUTS) == [((r, 4), 4, 16) for r in (3, 4, 5)]  # the oldest forgotten


def test_a_plain_tensor_without_storage_is_refused_naming_its_key():
    """A functional wrapper is of type torch.Tensor but holds no storage: the short path to
    its bytes must leave it to the check that names the key."""
    from ckstore.errors import UnsupportedValueError

    wrapped = torch._to_functional_tensor(torch.randn(3))
    with pytest.raises(UnsupportedValueError, match="'s/w'"):
        as_cpu_tensor(wrapped, "s/w")
