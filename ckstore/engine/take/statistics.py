"""Per-chunk health figures, computed on the bytes a take hashes anyway.

A take's workers hash each chunk (``LocalTake.hash``); for a floating-point chunk they also
call :func:`chunk_stats` on the same bytes, still in cache: NaN and Inf element counts and
the sum of squares of the finite elements. The figures of a tensor are the sums over its
chunks (``engine/take/guard.py``).

The common case costs one reduction in the tensor's own dtype (``torch.linalg.vector_norm``,
which accumulates 16-bit floats in float32): a finite norm proves there is no NaN or Inf.
Only a chunk whose norm is not finite (a NaN, an Inf, or a norm past the dtype's range) is
counted element by element and summed again in float64.
"""

from __future__ import annotations

import math

import torch

from ...format.dtypes import DTYPES

Stats = tuple[int, int, float]
"""(NaN elements, Inf elements, sum of squares of the finite elements)."""

_UPCAST = {
    "float8_e4m3fn": torch.float32,
    "float8_e4m3fnuz": torch.float32,
    "float8_e5m2": torch.float32,
    "float8_e5m2fnuz": torch.float32,
    "float8_e8m0fnu": torch.float32,
    "complex32": torch.complex64,
}
"""Dtypes ``vector_norm`` does not reduce: converted first (rare, small)."""


def measured(dtype: str) -> bool:
    """Whether tensors of ``dtype`` get health figures: floating-point and complex ones
    (integers and bools hold no NaN or Inf; ``float4_e2m1fn_x2`` packs two values a byte)."""
    t = DTYPES.get(dtype)
    return t is not None and (t.is_floating_point or t.is_complex) and dtype != "float4_e2m1fn_x2"


def chunk_stats(view: memoryview, dtype: str) -> Stats:
    """The figures of a chunk's raw bytes (little-endian elements of ``dtype``)."""
    if len(view) == 0:
        return 0, 0, 0.0
    if view.readonly:  # torch views only writable buffers without a warning; a copy is rare
        view = memoryview(bytearray(view))
    t = torch.frombuffer(view, dtype=DTYPES[dtype])
    return tensor_stats(t.to(_UPCAST[dtype]) if dtype in _UPCAST else t)


def tensor_stats(t: torch.Tensor) -> Stats:
    """The figures of a CPU tensor (any shape)."""
    if t.numel() == 0:
        return 0, 0, 0.0
    norm = float(torch.linalg.vector_norm(t))
    if math.isfinite(norm):
        return 0, 0, norm * norm
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    finite = t[torch.isfinite(t)]
    wide = finite.to(torch.complex128 if t.is_complex() else torch.float64)
    return nan, inf, float(torch.linalg.vector_norm(wide)) ** 2
