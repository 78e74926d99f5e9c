"""The dtypes ckstore stores, by name, and how their bytes are laid out.

Names are the ``torch.<name>`` spelling (``"bfloat16"``). Resolution goes through an explicit
table, never ``getattr`` on a name read from the store (loading never runs code from the store).
Every dtype is stored as its raw little-endian bytes, so a chunk's id is the same on every host.

The table of names and element sizes (:data:`ITEMSIZE`) needs no torch, so reading manifests
(``log``, ``diff``, ``check`` ...) never imports it; the torch dtype objects (:data:`DTYPES`,
:func:`dtype_name`, :func:`dtype_from_name`) import torch on first use.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from ..errors import CorruptionError, UnsupportedValueError

if TYPE_CHECKING:
    import torch

    DTYPES: dict[str, torch.dtype]
    """Stored name -> torch dtype, for the names the installed torch has (built on first use)."""

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch hosts in practice
    raise ImportError("ckstore stores little-endian bytes and needs a little-endian host")

_FLOATING = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
}
_OTHER = {
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bits8": 1,
    "bits16": 2,
}
ITEMSIZE: dict[str, int] = {**_FLOATING, **_OTHER}
"""Every dtype name ckstore stores -> bytes per element (``torch.dtype.itemsize``)."""
# Byte grouping pays only where one byte of each element (sign + exponent) is far more
# predictable than the others: floats of two bytes or more.
GROUPED = frozenset(_FLOATING)


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        n: getattr(torch, n) for n in ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)
    }


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {d: n for n, d in _torch_dtypes().items()}


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    """Return the stored name of ``dtype``; refuse dtypes ckstore cannot store bit-exactly."""
    try:
        return _names()[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"key {key!r}: tensors of dtype {dtype} are not supported (quantized and sub-byte "
            "dtypes have no stable byte layout); dequantize or convert the tensor first"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype for a stored name; an unknown name means a corrupt manifest.

    Raises:
        CorruptionError: ckstore never stores a dtype of that name.
        UnsupportedValueError: a dtype ckstore knows that the installed torch lacks.
    """
    try:
        return _torch_dtypes()[name]
    except KeyError:
        pass
    if name in ITEMSIZE:
        import torch

        raise UnsupportedValueError(
            f"dtype {name!r} is not in the installed torch {torch.__version__}; upgrade torch "
            "to read it"
        )
    raise CorruptionError(f"manifest names an unknown dtype {name!r}")


def itemsize(name: str) -> int:
    """Bytes per element of the named dtype (no torch needed)."""
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise CorruptionError(f"manifest names an unknown dtype {name!r}") from None
