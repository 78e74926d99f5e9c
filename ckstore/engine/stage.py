"""Staging for async takes: a private copy of every tensor, containers rebuilt alike."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch


def stage(obj: Any) -> Any:
    """Copy tensors/arrays (to CPU) and rebuild containers; immutable scalars are shared.

    After this returns, nothing the caller does to its tensors, dicts or lists changes the copy.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = stage(v)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = stage(meta)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [stage(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(stage(v) for v in obj)
    return obj
