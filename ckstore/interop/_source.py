"""The import record: what an imported snapshot came from, kept so export can write it back.

An import adds the app ``_source`` to the snapshot: ``_source/info`` is one JSON string (format,
source name, how the file's object mapped onto apps, the safetensors ``__metadata__``, DCP's
chunk layout, files left out) and ``_source/files/<path>`` holds each file kept beside the
weights (``config.json``, tokenizer files) as a uint8 tensor, so it is chunked, deduplicated
and verified like any tensor. A snapshot without ``_source`` (a plain ``take``) exports too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.view import SnapshotView
from ..errors import CorruptionError
from ..format.manifest import ValueEntry
from ._apps import SOURCE_APP, Held, unescape

INFO_KEY = f"{SOURCE_APP}/info"
FILES_PREFIX = f"{SOURCE_APP}/files/"


@dataclass
class Source:
    """Where an imported snapshot came from.

    Attributes:
        format: ``safetensors``, ``hf``, ``torch`` or ``dcp``.
        name: the file or folder name imported (no directories).
        flat_app: the app a flat name -> tensor mapping went to (None: one app per key).
        safetensors_metadata: the ``__metadata__`` of the imported safetensors file(s).
        torch_files: file name -> app for ``torch.save`` files imported beside the weights of
            a folder ("" when the file's top-level keys became apps).
        dcp_chunks: DCP fqn -> its chunks ``[[offsets, sizes], ...]`` as the source wrote them.
        skipped: files of the source left out, with why.
        files: kept file path (relative, '/'-separated) -> its bytes as a uint8 tensor.
    """

    format: str
    name: str
    flat_app: str | None = None
    safetensors_metadata: dict[str, str] = field(default_factory=dict)
    torch_files: dict[str, str] = field(default_factory=dict)
    dcp_chunks: dict[str, list[list[list[int]]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    files: dict[str, torch.Tensor] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "name": self.name,
            "flat_app": self.flat_app,
            "safetensors_metadata": self.safetensors_metadata,
            "torch_files": self.torch_files,
            "dcp_chunks": self.dcp_chunks,
            "skipped": self.skipped,
        }

    def app(self) -> Held:
        """The ``_source`` app for the take."""
        return Held({"info": json.dumps(self.info(), sort_keys=True), "files": dict(self.files)})

    def metadata(self) -> dict[str, Any]:
        """Small provenance for the snapshot's metadata (shown by ``ckstore show``)."""
        return {"imported_from": {"format": self.format, "name": self.name}}


def keep_file(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor mapped from disk (read lazily, never copied whole)."""
    size = os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def load_source(view: SnapshotView) -> Source | None:
    """The import record of a snapshot, or None if it was not imported (a plain take)."""
    entries = view.manifest.entries
    entry = entries.get(INFO_KEY)
    if entry is None:
        return None
    where = f"snapshot {view.ref}"
    try:
        assert isinstance(entry, ValueEntry)
        info = json.loads(entry.value)
        src = Source(
            format=str(info["format"]),
            name=str(info["name"]),
            flat_app=info.get("flat_app"),
            safetensors_metadata={
                str(k): str(v) for k, v in (info.get("safetensors_metadata") or {}).items()
            },
            torch_files={str(k): str(v) for k, v in (info.get("torch_files") or {}).items()},
            dcp_chunks=dict(info.get("dcp_chunks") or {}),
            skipped=[str(s) for s in info.get("skipped") or []],
        )
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise CorruptionError(
            f"{where}: its import record {INFO_KEY!r} is malformed ({exc})"
        ) from exc
    return src


def kept_files(view: SnapshotView) -> dict[str, str]:
    """Kept file path -> its key in the snapshot."""
    out = {}
    for key in view.manifest.entries:
        if key.startswith(FILES_PREFIX):
            out[unescape(key[len(FILES_PREFIX) :])] = key
    return out
