"""``torch.save`` files, in and out.

Import loads the file with ``weights_only=True`` (memory-mapped when it is in the zip format, so
a file larger than memory streams into the take) and maps its object onto apps
(:func:`~ckstore.interop._apps.app_state_of`). Export rebuilds the nested state dict, ``{app:
state}``, or the flat mapping itself when the snapshot came from one, and ``torch.save``\\ s it;
tensors past the memory budget are memory-mapped temporary files while it is written. The
result loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..engine.repository import SnapshotView
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


def export(view: SnapshotView, out: str, keys: list[str], src: Source | None, budget: int) -> dict[str, Any]:
    name = src.name if src is not None and src.format == "torch" else DEFAULT_NAME
    with Spill(budget, out) as spill:
        objs = build_objects(view, keys, spill, view.reader())
        saved = export_object(objs, src)
        torch.save(saved, inside(out, name, f"snapshot {view.ref}"))
        digests = object_digests(saved)
    return {"files": [name], "tensors": sum(1 for k in keys if view.manifest.entries[k].kind == "tensor"),
            "tensor_digests": {name: digests}}
