"""The dtypes ckstore stores, by name, and how their bytes are laid out.

Names are the ``torch.<name>`` spelling (``"bfloat16"``). Resolution goes through an explicit
table, never ``getattr`` on a name read from the store (loading never runs code from the store).
Every dtype is stored as its raw little-endian bytes, so a chunk's id is the same on every host.
"""

from __future__ import annotations

import sys

import torch

from ..errors import CorruptionError, UnsupportedValueError

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch hosts in practice
    raise ImportError("ckstore stores little-endian bytes and needs a little-endian host")

_FLOATING = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
)
_OTHER = (
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "bits8",
    "bits16",
)

DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in (*_FLOATING, *_OTHER) if isinstance(getattr(torch, n, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}
# Byte grouping pays only where one byte of each element (sign + exponent) is far more
# predictable than the others: floats of two bytes or more.
GROUPED = frozenset(n for n in _FLOATING if n in DTYPES)


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    """Return the stored name of ``dtype``; refuse dtypes ckstore cannot store bit-exactly."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"key {key!r}: tensors of dtype {dtype} are not supported (quantized and sub-byte "
            "dtypes have no stable byte layout); dequantize or convert the tensor first"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype for a stored name; an unknown name means a corrupt manifest."""
    try:
        return DTYPES[name]
    except KeyError:
        raise CorruptionError(f"manifest names an unknown dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of the named dtype."""
    return dtype_from_name(name).itemsize
