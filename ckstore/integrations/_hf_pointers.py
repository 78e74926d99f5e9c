"""A Trainer checkpoint folder's files, replaced by pointers into the snapshot imported from it.

:class:`~ckstore.integrations.transformers.CkstoreCallback` calls these after the import of the
folder committed, so a pointer only ever names a snapshot that exists:

- :func:`point_torch_files`: each top-level ``.pt`` / ``.pth`` file the import took as an app
  (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``scaler.pt``) becomes a pointer to
  that app, at its own path;
- :func:`point_weights`: the safetensors weights (``model.safetensors``, or
  ``model.safetensors.index.json`` and the shards it lists) become one ``pytorch_model.bin``, a
  pointer to the app ``model`` (the whole state dict): the name the Trainer's
  ``_load_from_checkpoint`` and ``_load_best_model`` open first, with
  ``torch.load(weights_only=True)``, and that ``from_pretrained`` loads when a folder holds no
  safetensors.

Every pointer is written atomically (a temporary file in the folder, fsync, rename). The weights
go in this order, so a crash at any point leaves a folder that loads the same weights: the
pointer is written (the real files still there, and preferred by every loader), then the index
is deleted (the shards it listed are then ignored: loaders find ``pytorch_model.bin``), then
the safetensors files. Before deleting anything, every tensor of those files is checked to be
in the snapshot's app ``model`` with its shape; a folder that does not match keeps its real
files. A real ``pytorch_model.bin`` (not a pointer) is never overwritten.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from ..engine.files import write_atomic
from ..format.manifest import TensorEntry
from ..snapshot import StoredSnapshot
from ..store import Store
from .pointer import Pointer, read_file, to_bytes

TORCH_FILES = (".pt", ".pth")
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
WEIGHTS_POINTER = "pytorch_model.bin"
"""``transformers``' ``WEIGHTS_NAME``: the weights file its loaders fall back to."""
MODEL_APP = "model"


def point_torch_files(store: Store, snap: StoredSnapshot, folder: str, ident: str) -> list[str]:
    """Replace each top-level torch file of ``folder`` imported as an app by a pointer to it.

    Args:
        store: the store ``snap`` is in.
        snap: the snapshot just imported from ``folder``.
        folder: the checkpoint folder.
        ident: the folder's identity (its full normalised path), recorded in the pointers.

    Returns:
        The names of the files replaced.
    """
    apps = set(snap.manifest.apps)
    done = []
    for name in sorted(os.listdir(folder)):
        app, dot, suffix = name.rpartition(".")
        path = os.path.join(folder, name)
        if not dot or f".{suffix}" not in TORCH_FILES or app not in apps:
            continue
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        write_atomic(path, to_bytes(Pointer.to(store, snap.id, os.path.join(ident, name), app=app)))
        done.append(name)
    return done


def point_weights(store: Store, snap: StoredSnapshot, folder: str, ident: str) -> bool:
    """Replace the safetensors weights of ``folder`` by one ``pytorch_model.bin`` pointer to the
    snapshot's app ``model`` (in the order the module docstring gives).

    Args:
        store: the store ``snap`` is in.
        snap: the snapshot just imported from ``folder`` (committed).
        folder: the checkpoint folder.
        ident: the folder's identity, recorded in the pointer.

    Returns:
        Whether the weights are now a pointer. False, with every file left as it was, when the
        folder has no safetensors weights, holds a real ``pytorch_model.bin``, or its tensors
        are not all in the snapshot's app ``model``.
    """
    files = _safetensors_files(folder)
    target = os.path.join(folder, WEIGHTS_POINTER)
    if not files or (os.path.lexists(target) and read_file(target) is None):
        return False
    if not _in_snapshot(snap, [os.path.join(folder, f) for f in files]):
        return False
    pointer = Pointer.to(store, snap.id, os.path.join(ident, WEIGHTS_POINTER), app=MODEL_APP)
    write_atomic(target, to_bytes(pointer))
    for name in (SAFE_INDEX, *files):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    return True


def _safetensors_files(folder: str) -> list[str]:
    """The safetensors files the import read as the weights: the shards the index lists, or
    ``model.safetensors``; [] when there are none or the index is unreadable."""
    index = os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted({str(v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        ok = all("/" not in s and os.path.isfile(os.path.join(folder, s)) for s in shards)
        return shards if shards and ok else []
    return [SAFE_WEIGHTS] if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS)) else []


def _in_snapshot(snap: StoredSnapshot, paths: list[str]) -> bool:
    """Whether every tensor of the safetensors files ``paths`` is in ``snap``'s app ``model``
    with the same shape (headers only are read)."""
    entries = snap.manifest.entries
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                entry = entries.get(f"{MODEL_APP}/{name}")
                shape = list(f.get_slice(name).get_shape())
                if not isinstance(entry, TensorEntry) or list(entry.shape) != shape:
                    return False
    return True
