"""Hard limits on what crosses the trust boundary, and the checks that enforce them.

Every number a caller passes (a step, a gc grace period, a fraction of packs to read, a thread
count) and every structure ckstore encodes (state trees, values, metadata) is checked here
against a documented limit before anything is allocated, written or sent to the index, so a bad
input fails at once with :class:`InvalidInputError` naming the option, never deep inside
SQLite, the JSON encoder or the allocator. docs/FORMAT.md section 10 lists the limits.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidInputError, MetadataWarning, warn

MAX_DEPTH = 64
"""Most containers (dicts, lists, tuples) nested in one state dict, value or metadata object.

Deeper structures are refused when taken and when read: they cannot come from a real
``state_dict()``, and recursion past the interpreter's stack would fail untyped."""

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
"""Integers the index stores (steps, limits): signed 64-bit."""

UINT64_MAX = 2**64 - 1
"""Integers in values may be signed or unsigned 64-bit (e.g. a ``torch.initial_seed()``)."""


def check_int(name: str, value: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    """``value`` as an int in ``[lo, hi]`` (bools refused).

    Raises:
        InvalidInputError: not an integer, or out of range; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(
            f"{name} must be an integer from {lo} to {_show(hi)}, got {value!r}"
        )
    if not lo <= int(value) <= hi:
        raise InvalidInputError(f"{name} must be from {lo} to {_show(hi)}, got {int(value)}")
    return int(value)


def check_number(
    name: str, value: Any, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False
) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    Raises:
        InvalidInputError: not a real number, NaN, infinite, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{name} must be a number, got {value!r}")
    v = float(value)
    low_ok = v > lo if lo_open else v >= lo
    if not math.isfinite(v) or not low_ok or v > hi:
        bound = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi == math.inf else f" and <= {hi:g}")
        raise InvalidInputError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def check_fraction(name: str, value: Any) -> float:
    """``True`` -> 1.0, ``False``/``None`` -> 0.0, else a number in ``[0, 1]``.

    Raises:
        InvalidInputError: anything else (``2.0``, ``-1``, NaN, a string).
    """
    if value is None or value is False:
        return 0.0
    if value is True:
        return 1.0
    return check_number(name, value, 0.0, 1.0)


def check_metadata(metadata: Any, where: str = "metadata") -> dict[str, Any]:
    """A copy of ``metadata`` as plain JSON: str keys, finite numbers, int64 integers, at most
    :data:`MAX_DEPTH` levels (tuples become lists).

    A NaN or infinite float (``metadata={"loss": loss.item()}`` once the loss diverged) is
    recorded as null, with one :class:`~ckstore.errors.MetadataWarning` naming its path: a
    take must not fail for the figure that says the run went wrong.

    Raises:
        InvalidInputError: the message names the offending path.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(
            f"{where} must be a dict of JSON values, got {type(metadata).__name__}"
        )
    nonfinite: list[str] = []
    out = _json_copy(metadata, where, 0, nonfinite)
    assert isinstance(out, dict)
    if nonfinite:
        warn(
            MetadataWarning(
                f"{', '.join(nonfinite)}: not a finite number, recorded as null (JSON has no "
                "NaN or infinity)"
            )
        )
    return out


def _json_copy(value: Any, path: str, depth: int, nonfinite: list[str]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return check_int(path, value, INT64_MIN, INT64_MAX)
    if isinstance(value, numbers.Real):
        v = float(value)
        if not math.isfinite(v):
            nonfinite.append(f"{path} = {v!r}")
            return None
        return v
    if isinstance(value, (Mapping, list, tuple)):
        if depth >= MAX_DEPTH:
            raise InvalidInputError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise InvalidInputError(
                        f"{path}: key {k!r} is a {type(k).__name__}; metadata keys must be str"
                    )
                out[k] = _json_copy(v, f"{path}[{k!r}]", depth + 1, nonfinite)
            return out
        return [_json_copy(v, f"{path}[{i}]", depth + 1, nonfinite) for i, v in enumerate(value)]
    raise InvalidInputError(
        f"{path}: a {type(value).__name__} is not JSON (metadata holds str, finite numbers, "
        "bool, None, lists and dicts with str keys)"
    )


def _show(n: float) -> str:
    if n == INT64_MAX:
        return "2**63-1"
    if n == UINT64_MAX:
        return "2**64-1"
    return str(n)
