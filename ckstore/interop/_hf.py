"""safetensors files and Hugging Face model folders, in and out.

Import: a ``.safetensors`` file becomes the app ``model`` (one entry per tensor, named as in
the file). A folder imports its weights (``model.safetensors``, or the shards listed in
``model.safetensors.index.json``; ``pytorch_model.bin`` and its index where there is no
safetensors), the ``*.pt``/``*.pth`` files beside them as one app each (a Trainer checkpoint's
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``; loaded weights-only), and keeps every
other file (``config.json``, tokenizer files, ``trainer_state.json``, sub-folders) byte for
byte. Other weight formats and hidden files are left out and listed in the import record.

Export writes the Hugging Face layout: shards of at most ``shard_bytes``
(``model.safetensors``, or ``model-00001-of-0000N.safetensors``), ``model.safetensors.index.json``
(``metadata.total_size`` and the ``weight_map``), each shard's ``__metadata__`` naming the
snapshot (plus the source's own metadata, e.g. ``format: pt``), the kept files and torch files
written back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.restore.reader import Reader
from ..engine.view import SnapshotView
from ..errors import InvalidInputError
from ..format.digests import SIDECAR
from ..format.manifest import TensorEntry
from ._apps import FLAT_APP, SOURCE_APP, Held, flat_names, is_flat
from ._digests import object_digests
from ._outdir import inside
from ._read import build_objects, entry_of, tensor_bytes
from ._safeload import load_torch
from ._safetensors import Planned, check_dtype, map_tensors, read_header, write_stream
from ._source import Source, keep_file, kept_files
from ._spill import Spill

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_NAME = "pytorch_model.bin"
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default ``max_shard_size`` ("5GB")."""
OTHER_WEIGHTS = (
    ".safetensors",
    ".bin",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".tflite",
    ".ot",
    ".pb",
)
TORCH_SUFFIXES = (".pt", ".pth")


def has_weights(path: str) -> bool:
    """Whether folder ``path`` holds a model's weights as Hugging Face names them (a
    safetensors file or index, ``pytorch_model.bin`` or its index)."""
    names = os.listdir(path)
    return any(n in (INDEX_NAME, WEIGHTS_NAME, BIN_INDEX_NAME, BIN_NAME) for n in names) or any(
        n.endswith(".safetensors") for n in names
    )


def import_file(path: str) -> tuple[dict[str, Any], Source]:
    """A single safetensors file: app ``model``."""
    header = read_header(path)
    src = Source("safetensors", os.path.basename(path), FLAT_APP, header.metadata)
    return {FLAT_APP: Held(map_tensors(path, header))}, src


@dataclass
class _Folder:
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_files: set[str] = field(default_factory=set)
    metadata: dict[str, str] = field(default_factory=dict)


def import_folder(path: str) -> tuple[dict[str, Any], Source]:
    """A Hugging Face model or Trainer checkpoint folder (see the module docstring)."""
    folder = _weights(path)
    src = Source("hf", os.path.basename(os.path.abspath(path)), FLAT_APP, folder.metadata)
    apps: dict[str, Any] = {FLAT_APP: Held(folder.weights)} if folder.weights else {}
    for rel in _files(path):
        full = os.path.join(path, rel)
        if rel in folder.weight_files or rel in (INDEX_NAME, BIN_INDEX_NAME, SIDECAR):
            continue  # (an export's digests are checked by the import, and written by the next export)
        if "/" not in rel and rel.endswith(TORCH_SUFFIXES):
            app = rel.rsplit(".", 1)[0]
            if app in apps or app == SOURCE_APP:
                raise InvalidInputError(f"{full}: its app name {app!r} is taken; rename the file")
            obj = load_torch(full)
            apps[app] = Held(obj)
            src.torch_files[rel] = app
        elif rel.endswith(OTHER_WEIGHTS) or rel.endswith(TORCH_SUFFIXES):
            src.skipped.append(f"{rel}: another weights file or a pickled object, not imported")
        else:
            src.files[rel] = keep_file(full)
    if not apps:
        raise InvalidInputError(
            f"{path}: no weights found (no *.safetensors, {BIN_NAME}, *.pt or *.pth)"
        )
    return apps, src


def _files(root: str) -> list[str]:
    """Regular files under ``root`` ('/'-separated, sorted), hidden files and folders left out."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        rel_dir = os.path.relpath(d, root)
        for name in sorted(files):
            if not name.startswith(".") and os.path.isfile(os.path.join(d, name)):
                out.append(name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/"))
    return out


def _weights(path: str) -> _Folder:
    folder = _Folder()
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        shards = _index_shards(path, index)
    elif os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        shards = [WEIGHTS_NAME]
    else:
        shards = []
    for shard in shards:
        full = os.path.join(path, shard)
        header = read_header(full)
        folder.metadata = folder.metadata or header.metadata
        _add(folder, full, map_tensors(full, header))
        folder.weight_files.add(shard)
    if shards:
        return folder
    index = os.path.join(path, BIN_INDEX_NAME)
    bins = (
        _index_shards(path, index)
        if os.path.isfile(index)
        else ([BIN_NAME] if os.path.isfile(os.path.join(path, BIN_NAME)) else [])
    )
    for shard in bins:
        full = os.path.join(path, shard)
        obj = load_torch(full)
        if not is_flat(obj):
            raise InvalidInputError(f"{full}: not a name -> tensor state dict")
        _add(folder, full, dict(obj))
        folder.weight_files.add(shard)
    return folder


def _add(folder: _Folder, path: str, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if name in folder.weights:
            raise InvalidInputError(f"{path}: tensor {name!r} is also in another shard")
        folder.weights[name] = t


def _index_shards(root: str, index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = list(dict.fromkeys(str(v) for v in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{index}: not a valid weights index ({exc})") from None
    for name in files:
        if (
            os.path.isabs(name)
            or ".." in name.split("/")
            or not os.path.isfile(os.path.join(root, name))
        ):
            raise InvalidInputError(f"{index}: lists shard {name!r}, which is not a file in {root}")
    return files


# --- export ------------------------------------------------------------------------------------
def export(
    view: SnapshotView, out: str, keys: list[str], src: Source | None, shard_bytes: int, budget: int
) -> dict[str, Any]:
    """Write the Hugging Face layout into ``out``; returns what was written."""
    torch_apps = {app: rel for rel, app in (src.torch_files if src else {}).items()}
    entries = view.manifest.entries
    weight_keys = [k for k in keys if k.split("/", 1)[0] not in torch_apps]
    tensors = [k for k in weight_keys if isinstance(entry_of(view, k), TensorEntry)]
    skipped = [k for k in weight_keys if k not in tensors]
    names = flat_names(tensors, f"snapshot {view.ref}")
    planned = []
    for k in tensors:
        e = entries[k]
        assert isinstance(e, TensorEntry)
        check_dtype(e.dtype, k)
        planned.append(Planned(names[k], k, e.dtype, e.shape))
    files = _write_shards(view, out, planned, src, shard_bytes, budget)
    digests: dict[str, dict[str, str]] = {}
    files += _write_torch_files(view, out, keys, torch_apps, budget, digests)
    files += _write_kept(view, out)
    return {
        "files": files,
        "tensors": len(planned),
        "skipped_values": skipped,
        "tensor_digests": digests,
    }


def _shards(planned: list[Planned], shard_bytes: int) -> list[list[Planned]]:
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_shards(
    view: SnapshotView,
    out: str,
    planned: list[Planned],
    src: Source | None,
    shard_bytes: int,
    budget: int,
) -> list[str]:
    if not planned:
        return []
    shards = _shards(planned, shard_bytes)
    n = len(shards)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    meta = dict(src.safetensors_metadata if src else {})
    meta.setdefault("format", "pt")
    meta.update(
        {
            "ckstore.snapshot": view.id,
            "ckstore.run": view.run,
            "ckstore.step": "" if view.step is None else str(view.step),
        }
    )
    reader = Reader.of(view)
    for name, items in zip(names, shards):
        with open(os.path.join(out, name), "wb") as f:
            write_stream(f, items, meta, tensor_bytes(reader, view, [p.key for p in items], budget))
    index = {
        "metadata": {"total_size": sum(p.nbytes for p in planned), "ckstore.snapshot": view.id},
        "weight_map": {p.name: name for name, items in zip(names, shards) for p in items},
    }
    with open(os.path.join(out, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return [*names, INDEX_NAME]


def _write_torch_files(
    view: SnapshotView,
    out: str,
    keys: list[str],
    torch_apps: dict[str, str],
    budget: int,
    digests: dict[str, dict[str, str]],
) -> list[str]:
    written = []
    for app, rel in torch_apps.items():
        mine = [k for k in keys if k.split("/", 1)[0] == app]
        if not mine:
            continue
        with Spill(budget, out) as spill:
            obj = build_objects(view, mine, spill, Reader.of(view))[app]
            torch.save(obj, inside(out, rel, f"snapshot {view.ref}"))
            digests[rel] = object_digests(obj)
        written.append(rel)
    return written


def _write_kept(view: SnapshotView, out: str) -> list[str]:
    kept = kept_files(view)
    if not kept:
        return []
    reader = Reader.of(view)
    for rel, key in kept.items():
        dest = inside(out, rel, f"snapshot {view.ref}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as f:
            f.write(reader.read_tensors([key])[key].numpy().tobytes())
    return sorted(kept)
