"""Zero-copy byte views of tensors, and tensors built from stored entries."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .dtypes import dtype_from_name, dtype_name


def as_cpu_tensor(value: Any, key: str) -> torch.Tensor:
    """The value as a plain CPU torch tensor whose bytes are its elements.

    NumPy arrays are wrapped without a copy; tensors on another device are copied to the CPU;
    conjugate and negative-bit views (``.conj()`` of a complex tensor) are resolved. Tensors
    without readable data are refused before anything is allocated (:func:`check_tensor`).

    Raises:
        UnsupportedValueError: naming ``key`` and saying what to do instead.
    """
    if isinstance(value, np.ndarray):
        if (
            value.dtype.kind not in "biufc"
            or value.dtype.byteorder == ">"
            or value.dtype.itemsize > (16 if value.dtype.kind == "c" else 8)  # long double
        ):
            raise UnsupportedValueError(
                f"key {key!r}: NumPy arrays of dtype {value.dtype} are not supported; "
                "use a numeric little-endian dtype"
            )
        # ascontiguousarray makes a 0-d array 1-d: keep its shape
        return torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))
    if _plain_cpu(value):
        # a tensor that needs no detaching is used as it is: a new tensor object per tensor
        # and take is one more for Python's collector to promote
        return value if type(value) is torch.Tensor and not value.requires_grad else value.detach()
    check_tensor(value, key)
    t = value.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.resolve_conj().resolve_neg()


def check_tensor(value: Any, key: str) -> None:
    """Refuse a tensor ckstore cannot read the bytes of, before any copy or allocation.

    Refused: DTensor outside a distributed take, ShardedTensor, nested tensors, meta tensors
    (a shape without data: taking one would allocate its whole declared size), sparse and
    other non-strided layouts, quantized tensors, and tensors without storage (wrapper
    subclasses, fake tensors).

    Raises:
        UnsupportedValueError: naming ``key`` and saying what to do instead.
    """
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
    if value.is_nested:
        raise UnsupportedValueError(
            f"key {key!r}: nested tensors are not supported; store their components "
            "(e.g. list(t.unbind())) or a padded tensor (t.to_padded_tensor(0.0))"
        )
    if value.device.type == "meta":
        raise UnsupportedValueError(
            f"key {key!r}: a meta tensor has a shape ({list(value.shape)}) but no data; "
            "materialise it first (e.g. module.to_empty(device='cpu') and load or init weights)"
        )
    if value.is_sparse or value.layout != torch.strided:
        raise UnsupportedValueError(
            f"key {key!r}: sparse tensors are not supported; call .to_dense()"
        )
    if value.is_quantized:
        dtype_name(value.dtype, key)  # raises the typed error
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and getattr(value, "fake_mode", None):
        raise UnsupportedValueError(
            f"key {key!r}: a {type(value).__name__} holds no data (a fake tensor); "
            "take the real tensors"
        )
    try:
        ptr = value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise UnsupportedValueError(
            f"key {key!r}: a {type(value).__name__} has no storage to read ({exc}); "
            "convert it to a plain tensor in state_dict()"
        ) from exc
    if ptr == 0 and value.numel() > 0 and value.device.type == "cpu":
        raise UnsupportedValueError(
            f"key {key!r}: a {type(value).__name__} holds no data (a fake or meta tensor); "
            "materialise it first"
        )


def _plain_cpu(value: Any) -> bool:
    """A plain tensor (not a subclass) on the CPU, strided, not quantized, not a conjugate or
    negative-bit view, with storage: nothing :func:`check_tensor` refuses, nothing to resolve
    (the question costs about a microsecond; a take asks it of every tensor)."""
    return (
        type(value) in _PLAIN_TYPES
        and value.is_cpu
        and value.layout is torch.strided
        and not value.is_quantized
        and not value.is_conj()
        and not value.is_neg()
        and not value.is_nested
        and _has_data(value)
    )


def _has_data(t: torch.Tensor) -> bool:
    """Whether a plain tensor has storage with data (a functional or functorch wrapper, of
    type ``torch.Tensor`` too, has none: :func:`check_tensor` names it)."""
    try:
        return t.untyped_storage().data_ptr() != 0 or t.numel() == 0
    except (RuntimeError, NotImplementedError, TypeError):
        return False


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)
"""Dtypes ``Tensor.numpy()`` shares (``bfloat16`` and the float8 types have no NumPy twin)."""


NO_COPY_KERNEL = frozenset(
    d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if isinstance(d, torch.dtype)
)
"""Dtypes of one byte that torch has no copy (nor conversion) kernel for: copied as uint8."""


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or (a dtype torch cannot copy) the same elements viewed as ``uint8``."""
    return t.view(torch.uint8) if t.dtype in NO_COPY_KERNEL else t


def byte_view(t: torch.Tensor) -> memoryview:
    """A C-contiguous uint8 memoryview of a CPU tensor's elements (copies only if strided, or
    to resolve a conjugate or negative-bit view)."""
    if (
        t.dtype in _NUMPY_DTYPES  # quantized dtypes are not
        and type(t) in _PLAIN_TYPES
        and t.is_cpu
        and not t.is_nested
        and t.layout is torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
        and t.numel()
    ):
        plain = t.detach() if t.requires_grad else t
        return memoryview(plain.numpy()).cast("B")  # type: ignore[arg-type] # fewer calls
    t = t.resolve_conj().resolve_neg()
    if t.dtype in NO_COPY_KERNEL:  # torch cannot copy these strided: copy their bytes instead
        t = t.view(torch.uint8)
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
