"""``torch.save`` files, in and out.

Import loads the file with ``weights_only=True`` (memory-mapped when it is in the zip format, so
a file larger than memory streams into the take) and maps its object onto apps
(:func:`~ckstore.interop._apps.app_state_of`). Export rebuilds the nested state dict, ``{app:
state}``, or the flat mapping itself when the snapshot came from one, and ``torch.save``\\ s it;
tensors past the memory budget are memory-mapped temporary files while it is written. The
result loads with ``torch.load(path)`` and its default ``weights_only=True``: NumPy arrays
(an ``RNGState``'s) are written as tensors.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..engine.restore.reader import Reader
from ..engine.view import SnapshotView
from ._apps import app_state_of, is_flat
from ._digests import object_digests
from ._outdir import inside
from ._read import build_objects
from ._safeload import load_torch
from ._source import Source
from ._spill import Spill

DEFAULT_NAME = "checkpoint.pt"


def import_file(path: str) -> tuple[dict[str, Any], Source]:
    obj = load_torch(path)
    src = Source("torch", os.path.basename(path), "model" if is_flat(obj) else None)
    return app_state_of(obj, path), src


def export_object(objs: dict[str, Any], src: Source | None) -> Any:
    """What to save: the flat mapping when the snapshot came from one and only its app is exported."""
    if src is not None and src.flat_app is not None and list(objs) == [src.flat_app]:
        return objs[src.flat_app]
    return objs


def weights_only_safe(obj: Any) -> Any:
    """``obj`` with every NumPy array as a tensor (sharing its memory): ``torch.load``'s default
    ``weights_only=True`` refuses NumPy arrays, which an ``RNGState`` holds (``rng/numpy/1``)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: weights_only_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [weights_only_safe(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def export(
    view: SnapshotView, out: str, keys: list[str], src: Source | None, budget: int
) -> dict[str, Any]:
    name = src.name if src is not None and src.format == "torch" else DEFAULT_NAME
    with Spill(budget, out) as spill:
        objs = build_objects(view, keys, spill, Reader.of(view))
        saved = weights_only_safe(export_object(objs, src))
        torch.save(saved, inside(out, name, f"snapshot {view.ref}"))
        digests = object_digests(saved)
    return {
        "files": [name],
        "tensors": sum(1 for k in keys if view.manifest.entries[k].kind == "tensor"),
        "tensor_digests": {name: digests},
    }
