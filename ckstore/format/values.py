"""JSON encoding of the plain (non-tensor) values that live inside a manifest.

The encoding is lossless for: None, bool, int, float (NaN/inf and -0.0 included), str, bytes,
list, tuple, dict (any JSON-able keys, insertion order kept), ``torch.Size``, ``torch.dtype``,
``torch.device`` and NumPy scalars. JSON objects are only ever tags (``{"$tuple": [...]}``), so
a plain JSON array is a list and a plain JSON scalar is itself. Anything else is refused with an
error naming its key: there is no pickle fallback.

Decoding imports torch and NumPy only for the values that are their objects (``$dtype``,
``$device``, ``$size``, ``$np``), so reading a manifest of plain values loads neither.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from typing import Any

from ..errors import CorruptionError, UnsupportedValueError
from .dtypes import dtype_from_name, dtype_name

_NP_KINDS = frozenset("biufc")


def _refuse(value: Any, key: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"key {key!r}: cannot store a value of type {type(value).__module__}."
        f"{type(value).__qualname__}. ckstore stores tensors, NumPy arrays and plain data "
        "(numbers, strings, bytes, None, lists, tuples, dicts) and never pickles; convert it "
        "in state_dict() (e.g. to a tensor or a dict of plain values) or wrap plain data in "
        "ckstore.StateDict"
    )


def is_plain(value: Any) -> bool:
    """True for scalars this module encodes (not containers, not arrays)."""
    import numpy as np
    import torch

    return value is None or isinstance(
        value, (bool, int, float, str, bytes, bytearray, torch.dtype, torch.device, np.generic)
    )


def encode_value(value: Any, key: str) -> Any:
    """Encode ``value`` as JSON-able data; raise UnsupportedValueError naming ``key``."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.generic):  # before int/float: np.float64 subclasses float
        if value.dtype.kind not in _NP_KINDS:
            raise _refuse(value, key)
        return {"$np": value.dtype.str, "b64": base64.b64encode(value.tobytes()).decode()}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": repr(float(value))}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value, key)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.Size):
        return {"$size": [int(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, f"{key}/{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, f"{key}/{i}") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {
            "$dict": [[encode_value(k, key), encode_value(v, f"{key}/{k}")] for k, v in value.items()],
            "$cls": "OrderedDict" if isinstance(value, OrderedDict) else "dict",
        }
    raise _refuse(value, key)


def decode_value(data: Any) -> Any:
    """Inverse of :func:`encode_value`; malformed data raises CorruptionError."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        raise CorruptionError(f"manifest holds a value of unexpected JSON type {type(data).__name__}")
    try:
        return _decode_tag(data)
    except CorruptionError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptionError(f"malformed value tag in manifest: {str(data)[:200]}") from exc


def _decode_tag(data: dict[str, Any]) -> Any:
    if "$tuple" in data:
        return tuple(decode_value(v) for v in data["$tuple"])
    if "$dict" in data:
        cls = OrderedDict if data.get("$cls") == "OrderedDict" else dict
        return cls((decode_value(k), decode_value(v)) for k, v in data["$dict"])
    if "$float" in data:
        text = data["$float"]
        if text not in ("nan", "inf", "-inf"):
            raise ValueError(text)
        return float(text)
    if "$bytes" in data:
        return base64.b64decode(data["$bytes"], validate=True)
    if "$dtype" in data:
        return dtype_from_name(data["$dtype"])
    if "$device" in data:
        import torch

        return torch.device(str(data["$device"]))
    if "$size" in data:
        import torch

        return torch.Size(int(v) for v in data["$size"])
    if "$np" in data:
        import numpy as np

        dt = np.dtype(str(data["$np"]))
        if dt.kind not in _NP_KINDS:
            raise ValueError(dt)
        raw = base64.b64decode(data["b64"], validate=True)
        if len(raw) != dt.itemsize:
            raise ValueError("scalar length")
        return np.frombuffer(raw, dtype=dt)[0]
    raise ValueError("unknown tag")
