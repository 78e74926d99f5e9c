"""JSON encoding of the plain (non-tensor) values that live inside a manifest.

The encoding is lossless for: None, bool, int, float (inf and -0.0 included), str, bytes,
list, tuple, dict (any JSON-able keys, insertion order kept), ``torch.Size``, ``torch.dtype``,
``torch.device``, NumPy scalars and ``io.BytesIO`` (its whole buffer; it comes back positioned
at 0, as DCP users such as a loss history kept with ``torch.save`` expect); of dicts, an
``OrderedDict`` and a ``Counter`` keep their class. Some values come back as their plainer
kin: a Python float NaN as ``float("nan")`` (its sign and payload bits are not kept; a NumPy
scalar's or a tensor's are), a ``bytearray`` as ``bytes``, a named tuple as a ``tuple``,
another dict subclass as a ``dict`` and an enum of ``str`` or ``int`` as its ``str`` or ``int``
(encoded so at once: the handle a take returns holds what a reader will read). JSON objects are only ever tags (``{"$tuple": [...]}``), so
a plain JSON array is a list and a plain JSON scalar is itself. Anything else is refused with an
error naming its key: there is no pickle fallback.

Decoding imports torch and NumPy only for the values that are their objects (``$dtype``,
``$device``, ``$size``, ``$np``), so reading a manifest of plain values loads neither.
"""

from __future__ import annotations

import base64
import io
import math
import sys
from collections import Counter, OrderedDict
from typing import Any

from ..errors import CorruptionError, InvalidInputError, UnsupportedValueError
from .dtypes import dtype_from_name, dtype_name
from .limits import INT64_MAX, INT64_MIN, MAX_DEPTH, UINT64_MAX

_NP_KINDS = frozenset("biufc")


def _refuse(value: Any, key: str) -> UnsupportedValueError:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ma.MaskedArray):
        return UnsupportedValueError(
            f"key {key!r}: a NumPy masked array would lose its mask; store its data and its "
            "mask as two arrays (np.ma.getdata(x), np.ma.getmaskarray(x)) and rebuild it with "
            "np.ma.array(data, mask=mask)"
        )
    return UnsupportedValueError(
        f"key {key!r}: cannot store a value of type {type(value).__module__}."
        f"{type(value).__qualname__}. ckstore stores tensors, NumPy arrays and plain data "
        "(numbers, strings, bytes, None, lists, tuples, dicts) and never pickles; convert it "
        "in state_dict() (e.g. to a tensor or a dict of plain values) or wrap plain data in "
        "ckstore.StateDict"
    )


def is_plain(value: Any) -> bool:
    """True for scalars this module encodes (not containers, not arrays)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, bytearray, io.BytesIO)):
        return True
    # A torch or NumPy scalar exists only once its library is imported: look, never import
    # (reading a manifest's dict keys must not load torch).
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(value, (torch.dtype, torch.device))) or (
        np is not None and isinstance(value, np.generic)
    )


def encode_value(value: Any, key: str, depth: int = 0) -> Any:
    """Encode ``value`` as JSON-able data.

    ``depth`` counts the containers around ``value`` (at most :data:`MAX_DEPTH`).

    Raises:
        UnsupportedValueError: a type ckstore does not store (no pickle); names ``key``.
        InvalidInputError: an integer outside 64 bits, or containers nested too deep.
    """
    import numpy as np
    import torch

    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):  # a str enum: its text, as the stored JSON holds it
        return str.__str__(value)
    if isinstance(value, np.generic):  # before int/float: np.float64 subclasses float
        if value.dtype.kind not in _NP_KINDS:
            raise _refuse(value, key)
        return {"$np": value.dtype.str, "b64": base64.b64encode(value.tobytes()).decode()}
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            raise InvalidInputError(
                f"key {key!r}: the integer {_short(value)} does not fit in 64 bits (values hold "
                "integers from -2**63 to 2**64-1); store it as a string or bytes"
            )
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": repr(float(value))}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, io.BytesIO):
        return {"$bytesio": base64.b64encode(value.getbuffer()).decode()}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value, key)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.Size):
        return {"$size": [int(v) for v in value]}
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_DEPTH:
        raise InvalidInputError(f"key {key!r}: containers nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [encode_value(v, f"{key}/{i}", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, f"{key}/{i}", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {
            "$dict": [
                [encode_value(k, key, depth + 1), encode_value(v, f"{key}/{k}", depth + 1)]
                for k, v in value.items()
            ],
            "$cls": dict_class_name(value),
        }
    raise _refuse(value, key)


def _short(n: int) -> str:
    text = hex(n)
    return text if len(text) <= 40 else f"{text[:20]}...({n.bit_length()} bits)"


def decode_value(data: Any, depth: int = 0) -> Any:
    """Inverse of :func:`encode_value`; malformed data raises CorruptionError.

    Containers nested deeper than :data:`MAX_DEPTH` (counting from ``depth``) and integers
    outside 64 bits are malformed: no writer produces them.
    """
    if data is None or isinstance(data, (bool, float, str)):
        return data
    if isinstance(data, int):
        if not INT64_MIN <= data <= UINT64_MAX:
            raise CorruptionError(f"manifest holds an integer outside 64 bits: {_short(data)}")
        return data
    if depth >= MAX_DEPTH:
        raise CorruptionError(f"manifest holds a value nested deeper than {MAX_DEPTH} levels")
    if isinstance(data, list):
        return [decode_value(v, depth + 1) for v in data]
    if not isinstance(data, dict):
        raise CorruptionError(
            f"manifest holds a value of unexpected JSON type {type(data).__name__}"
        )
    try:
        return _decode_tag(data, depth + 1)
    except CorruptionError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise CorruptionError(f"malformed value tag in manifest: {str(data)[:200]}") from exc


def _decode_tag(data: dict[str, Any], depth: int) -> Any:
    if "$tuple" in data:
        return tuple(decode_value(v, depth) for v in _list(data["$tuple"]))
    if "$dict" in data:
        cls = DICT_CLASSES.get(data.get("$cls"), dict)
        out: dict[Any, Any] = cls()
        for pair in _list(data["$dict"]):
            k, v = _list(pair)
            key = decode_value(k, depth)
            hash(key)  # a list as a key: TypeError -> CorruptionError
            out[key] = decode_value(v, depth)
        return out
    if "$float" in data:
        text = data["$float"]
        if text not in ("nan", "inf", "-inf"):
            raise ValueError(text)
        return float(text)
    if "$bytes" in data:
        return base64.b64decode(data["$bytes"], validate=True)
    if "$bytesio" in data:
        return io.BytesIO(base64.b64decode(data["$bytesio"], validate=True))
    if "$dtype" in data:
        return dtype_from_name(data["$dtype"])
    if "$device" in data:
        import torch

        return torch.device(_str(data["$device"]))
    if "$size" in data:
        import torch

        sizes = _list(data["$size"])
        if not all(type(v) is int and 0 <= v <= INT64_MAX for v in sizes):
            raise ValueError("$size holds something other than non-negative int64s")
        return torch.Size(sizes)
    if "$np" in data:
        import numpy as np

        dt = np.dtype(_str(data["$np"]))
        if dt.kind not in _NP_KINDS:
            raise ValueError(dt)
        raw = base64.b64decode(data["b64"], validate=True)
        if len(raw) != dt.itemsize:
            raise ValueError("scalar length")
        return np.frombuffer(raw, dtype=dt)[0]
    raise ValueError("unknown tag")


def _list(v: Any) -> list[Any]:
    if type(v) is not list:
        raise TypeError(f"expected a JSON array, got {type(v).__name__}")
    return v


def _str(v: Any) -> str:
    if type(v) is not str:
        raise TypeError(f"expected a JSON string, got {type(v).__name__}")
    return v


DICT_CLASSES: dict[Any, type] = {"OrderedDict": OrderedDict, "Counter": Counter}
"""Dict subclasses kept by name (a ``Counter``: MultiStepLR's milestones, whose closed form
calls ``elements()``); any other name, and any other dict subclass, comes back a ``dict``."""


def dict_class_name(value: dict[Any, Any]) -> str:
    """The ``$cls`` a dict is recorded with (FORMAT.md, section 7.4)."""
    if isinstance(value, Counter):
        return "Counter"
    return "OrderedDict" if isinstance(value, OrderedDict) else "dict"
