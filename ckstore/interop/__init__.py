"""Checkpoints in and out of a store: safetensors / Hugging Face folders, ``torch.save``, DCP.

The public entry points are :meth:`ckstore.Store.import_checkpoint` and
:meth:`ckstore.Snapshot.export` (and ``ckstore import`` / ``ckstore export``); this package is
what they run. Import goes through the normal take: chunks dedup against the whole store, and
nothing is visible until the snapshot commits. Export reads through the snapshot's verifying
reader and publishes the output directory only once it is complete.

Formats (``format=``):

========== ================================================ ==========================================
name       import                                           export
========== ================================================ ==========================================
safetensors a ``.safetensors`` file                          Hugging Face layout: shards + index (the
                                                            model's weights and an imported folder's
                                                            torch files unless ``keys`` say more)
hf         a Hugging Face model / Trainer checkpoint folder same as ``safetensors``
torch      a ``torch.save`` file, loaded weights-only, or   one ``torch.save`` file
           a folder holding one (a torch export's)
dcp        a DCP checkpoint directory, any world size       a DCP directory (DCP's FileSystemWriter)
========== ================================================ ==========================================
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..engine.config import budget_cap
from ..engine.repository import Repository
from ..engine.view import SnapshotView
from ..errors import InvalidInputError, NotFoundError
from ..index.sqlite_paths import file_of
from . import _dcpdir, _hf, _outdir, _torchfile
from ._apps import SOURCE_APP, app_state_of, model_apps, select
from ._digests import torch_file_digests, verify_checkpoint, write_sidecar
from ._hf import DEFAULT_SHARD_BYTES
from ._safeload import is_zip
from ._source import Source, load_source
from ._spill import Spill

IMPORT_FORMATS = ("safetensors", "hf", "torch", "dcp")
EXPORT_FORMATS = ("safetensors", "hf", "torch", "dcp")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "EXPORT_FORMATS",
    "IMPORT_FORMATS",
    "SOURCE_APP",
    "ExportReport",
    "Loaded",
    "app_state_of",
    "detect_format",
    "export_snapshot",
    "load_checkpoint",
    "torch_file_digests",
    "verify_checkpoint",
]


def detect_format(path: str) -> str:
    """The import format of ``path``: a DCP or Hugging Face folder, a safetensors or torch file.

    Raises:
        NotFoundError: nothing at ``path``.
        InvalidInputError: the format cannot be told (pass ``format=``).
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, _dcpdir.METADATA_NAME)):
            return "dcp"
        if _hf.has_weights(path) or _torch_file_in(path) is None:
            return "hf"
        return "torch"  # one torch.save file and what lies beside it (a torch export's folder)
    if not os.path.isfile(path):
        raise NotFoundError(f"no checkpoint file or folder at {path!r}")
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith(TORCH_SUFFIXES) or is_zip(path):
        return "torch"
    with open(path, "rb") as f:
        head = f.read(9)
    if (
        len(head) == 9
        and head[8:9] == b"{"
        and struct.unpack("<Q", head[:8])[0] < os.path.getsize(path)
    ):
        return "safetensors"
    if head[:1] == b"\x80":
        return "torch"
    raise InvalidInputError(
        f"{path}: cannot tell its format; pass format= (--format) one of {', '.join(IMPORT_FORMATS)}"
    )


def _torch_file_in(folder: str) -> str | None:
    """The one ``torch.save`` file of a folder (``checkpoint.pt`` of a torch export, beside its
    ``ckstore-digests.json``), or None when it has none or several."""
    found = [
        os.path.join(folder, name)
        for name in sorted(os.listdir(folder))
        if name.lower().endswith(TORCH_SUFFIXES) and os.path.isfile(os.path.join(folder, name))
    ]
    return found[0] if len(found) == 1 else None


def _load(path: str, fmt: str, spill: Spill) -> tuple[dict[str, Any], Source]:
    if fmt == "dcp":
        return _dcpdir.import_dir(path, spill)
    if fmt == "torch":
        inside = _torch_file_in(path) if os.path.isdir(path) else None
        return _torchfile.import_file(inside or path)
    if fmt in ("safetensors", "hf"):
        return _hf.import_folder(path) if os.path.isdir(path) else _hf.import_file(path)
    raise InvalidInputError(
        f"unknown import format {fmt!r}; use one of {', '.join(IMPORT_FORMATS)}"
    )


@dataclass
class Loaded:
    """A checkpoint loaded for an import: the app_state to take, and the import's metadata."""

    apps: dict[str, Any]
    """App name -> state dict, as :func:`app_state_of` maps the checkpoint, plus the app
    ``_source`` (the import record and kept files)."""
    metadata: dict[str, Any]
    """``{"imported_from": {"format", "name"}}``: what the snapshot's metadata starts from."""


@contextmanager
def load_checkpoint(
    repo: Repository, path: str | os.PathLike[str], format: str | None = None
) -> Iterator[Loaded]:  # noqa: A002
    """Load the checkpoint at ``path`` (file or folder) for a take into ``repo``.

    Tensors are memory-mapped from the files, or (DCP) spilled to temporary files past the
    repository's memory budget; they stay valid inside the ``with`` block, where the caller
    takes them (``Store.import_checkpoint``).

    Raises:
        UnsafePickleError: a ``torch.save`` file (or DCP metadata) needs arbitrary unpickling.
        InvalidInputError: the path is not a readable checkpoint of the format.
        NotFoundError: nothing at ``path``.
    """
    path = os.fspath(path)
    fmt = format or detect_format(path)
    with Spill(budget_cap() if repo.memory_budget is None else repo.memory_budget) as spill:
        apps, src = _load(path, fmt, spill)
        apps[SOURCE_APP] = src.app()
        yield Loaded(apps, src.metadata())


@dataclass
class ExportReport:
    """What an export wrote.

    Attributes:
        path: the destination directory.
        format: the format written.
        files: file names written, relative to ``path``.
        tensors: tensors written.
        skipped_values: keys of plain values left out (safetensors holds tensors only).
        skipped_apps: apps a safetensors export left out by default (an optimizer's, a
            scheduler's state: not the model's weights); ``keys="**"`` exports them too.
    """

    path: str
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    skipped_values: list[str] = field(default_factory=list)
    skipped_apps: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "files": list(self.files),
            "tensors": self.tensors,
            "skipped_values": list(self.skipped_values),
            "skipped_apps": list(self.skipped_apps),
        }


def export_snapshot(
    view: SnapshotView,
    dest: str | os.PathLike[str],
    *,
    format: str = "safetensors",  # noqa: A002 - the option users type
    keys: Sequence[str] | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    memory_budget: int | None = None,
) -> ExportReport:
    """Write the snapshot (or the keys matching ``keys`` globs) to directory ``dest``, with
    the digests that prove it (safetensors metadata, ``ckstore-digests.json``)."""
    dest = os.path.abspath(os.fspath(dest))
    if format not in EXPORT_FORMATS:
        raise InvalidInputError(
            f"unknown export format {format!r}; use one of {', '.join(EXPORT_FORMATS)}"
        )
    if shard_bytes <= 0:
        raise InvalidInputError(f"shard_bytes must be positive, got {shard_bytes}")
    src = load_source(view)
    selected = select(view.manifest.entries, keys)
    skipped_apps: list[str] = []
    if keys is None and format in ("safetensors", "hf"):  # the model's weights, as HF has them
        # plus the apps an imported checkpoint folder held in their own files (a Trainer's
        # optimizer.pt, scheduler.pt, rng_state.pth): they go back there, not into the shards
        kept = set(model_apps(view.manifest.apps)) | set(src.torch_files.values() if src else ())
        apps = {k.split("/", 1)[0] for k in selected}
        if kept and not apps <= kept:
            skipped_apps = sorted(apps - kept)
            selected = [k for k in selected if k.split("/", 1)[0] in kept]
    if not selected:
        raise NotFoundError(
            f"snapshot {view.ref}: no key matches {list(keys or [])!r}; list them with `ckstore ls {view.id[:12]}`"
        )
    budget = view.repo.memory_budget if memory_budget is None else memory_budget
    if budget is None:  # the store's default: the most a restore stages by default
        budget = budget_cap()
    with _outdir.staged(dest, force, _in_use(view.repo)) as out:
        if format == "torch":
            done = _torchfile.export(view, out, selected, src, budget)
        elif format == "dcp":
            done = _dcpdir.export(view, out, selected, src, budget)
        else:
            done = _hf.export(view, out, selected, src, shard_bytes, budget)
        done["files"] = [*done["files"], write_sidecar(view, out, done.get("tensor_digests", {}))]
    return ExportReport(
        dest,
        format,
        done["files"],
        done["tensors"],
        done.get("skipped_values", []),
        skipped_apps,
    )


def _in_use(repo: Repository) -> dict[str, str]:
    """The local paths an export must never replace, and who uses each: the store exported
    from, its index file, and each of its remotes' store and index file (the index of a
    remote may lie outside every store: deleting it loses the remote's snapshots)."""
    found = {
        _local_folder(repo.url): "the store exported from",
        file_of(repo.index.url): "the index of the store exported from",
    }
    for remote in repo.index.list_remotes():
        found[_local_folder(remote.url)] = f"remote {remote.name!r}"
        found[file_of(remote.index) if remote.index else None] = (
            f"the index of remote {remote.name!r}"
        )
    return {path: user for path, user in found.items() if path}


def _local_folder(url: str) -> str | None:
    """The local folder of a store at ``url`` (None: a store elsewhere, e.g. ``s3://``)."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url else url
