"""Staging for async takes: a private copy of every tensor, containers rebuilt alike."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..errors import InvalidInputError
from ..format.boxes import is_dtensor
from ..format.limits import MAX_DEPTH
from ..format.tensors import check_tensor
from ..format.tree import join


def stage(obj: Any, key: str = "") -> Any:
    """Copy tensors/arrays (to CPU) and rebuild containers; immutable scalars are shared.

    After this returns, nothing the caller does to its tensors, dicts or lists changes the copy.
    Tensors ckstore cannot store are refused before anything is copied (``key`` names where
    ``obj`` sits, for the message); containers nested past ``MAX_DEPTH`` are refused too.

    Raises:
        UnsupportedValueError: a meta, nested or storage-less tensor (the key is named).
        InvalidInputError: containers nested too deep.
    """
    return _stage(obj, key, 0)


def _stage(obj: Any, key: str, depth: int) -> Any:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined] # a DTensor: its shard is staged
        check_tensor(local, key)
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, (dict, list, tuple)) and not isinstance(obj, torch.Size):
        if depth > MAX_DEPTH:  # depth 0 is the app_state mapping around the state dicts
            raise InvalidInputError(f"key {key!r}: containers nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _stage(v, join(key, str(k)), depth + 1)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = _stage(meta, key, depth + 1)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_stage(v, join(key, str(i)), depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_stage(v, join(key, str(i)), depth + 1) for i, v in enumerate(obj))
    return obj
