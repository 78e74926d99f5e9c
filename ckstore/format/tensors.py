"""Zero-copy byte views of tensors, and tensors built from stored entries."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .dtypes import dtype_from_name, dtype_name


def as_cpu_tensor(value: Any, key: str) -> torch.Tensor:
    """The value as a plain CPU torch tensor (NumPy arrays are wrapped without a copy)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.byteorder == ">":
            raise UnsupportedValueError(
                f"key {key!r}: NumPy arrays of dtype {value.dtype} are not supported; "
                "use a numeric little-endian dtype"
            )
        return torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise UnsupportedValueError(f"key {key!r}: expected a tensor, got {type(value).__name__}")
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "to_local"):
        raise UnsupportedValueError(
            f"key {key!r}: distributed tensors (DTensor) are stored by the distributed take; "
            "call it on every rank with torch.distributed initialised"
        )
    if type(value).__name__ == "ShardedTensor":
        raise UnsupportedValueError(
            f"key {key!r}: ShardedTensor (the deprecated pre-DTensor API) is not supported; "
            "convert it to a DTensor (torch.distributed.tensor) and take on every rank"
        )
    if value.is_sparse or value.layout != torch.strided:
        raise UnsupportedValueError(f"key {key!r}: sparse tensors are not supported; call .to_dense()")
    if value.is_quantized:
        dtype_name(value.dtype, key)  # raises the typed error
    t = value.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t


def byte_view(t: torch.Tensor) -> memoryview:
    """A C-contiguous uint8 memoryview of a CPU tensor's elements (copies only if strided)."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def empty_for(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A new contiguous CPU tensor to decode an entry into."""
    return torch.empty(shape, dtype=dtype_from_name(dtype))


def writable_view(t: torch.Tensor) -> memoryview:
    """A writable uint8 memoryview over a contiguous CPU tensor's storage."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor holding a copy of ``data``."""
    t = empty_for(dtype, shape)
    if data:
        writable_view(t)[:] = data
    return t
