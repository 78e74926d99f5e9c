"""Pointer files: a trainer's checkpoint file that holds where its snapshot is, not its bytes.

The trainers find, list, link, count and open checkpoints as files (Lightning's version
counter, ``ckpt_path="last"``, SLURM requeue, ``save_last="link"``, ``load_from_checkpoint``;
transformers' ``resume_from_checkpoint``). So at each path a trainer gives, the integrations
write a small file instead of the checkpoint (a few hundred bytes; the checkpoint's bytes are
in the store, deduplicated, once). The file is a valid ``torch.save`` file whose whole pickle
is one call, ``ckstore.integrations.pointer.load_pointer(<JSON>)``, and the JSON names the
store, the snapshot and the path the checkpoint was written at (:class:`Pointer`). So:

- ``torch.load(path)`` (also with ``weights_only=True``: importing this module adds
  :func:`load_pointer`, and nothing else, to torch's safe globals), Lightning's
  ``load_from_checkpoint(path)`` and transformers' loads return the checkpoint itself, read
  from the store and verified;
- ``os.listdir``, ``glob``, ``exists`` and symlinks see the checkpoint where the trainer put it.

What runs on load is this module's function alone: it opens the named store read-only (or uses
the handle this process already has open), reads the named snapshot by id and decodes its
values (docs/RELIABILITY.md, I6: nothing named by the file or the store is imported or
called). The file names no credentials: a store whose index needs a password must be open in
the reading process (``ckstore.open(url, index=...)``, or the integration's store).
:func:`read_file` recognises a pointer without running anything (a restricted unpickler that
resolves :func:`load_pointer` to a parser and refuses every other global).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointNotFoundError, CorruptionError, SnapshotNotFoundError
from ..interop import SOURCE_APP
from ..store import Store
from ..store_ref import StoreRef, opened
from ._values import from_plain

FORMAT = "ckstore-pointer"
VERSION = 1
MAX_POINTER_BYTES = 64 * 1024
"""A file larger than this is never read as a pointer (a real checkpoint)."""
_ID = re.compile(r"[0-9a-f]{16,128}")
_VALUE_CODECS = ("plain", "lightning")


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says.

    Attributes:
        store: the store's URL.
        snapshot: the snapshot's id.
        path: the full, normalised path the checkpoint was written at (its identity).
        app: the app whose object the file stands for (a Trainer folder's ``optimizer.pt``);
            None: the whole snapshot, one key per app (a Lightning checkpoint).
        values: how non-plain values were stored: ``"plain"``, or ``"lightning"`` (paths,
            namespaces, enum members and OmegaConf containers as marked dicts).
        index: the store's index URL (password hidden) when it is not the store's default.
    """

    store: str
    snapshot: str
    path: str
    app: str | None = None
    values: str = "plain"
    index: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "store": self.store,
                "snapshot": self.snapshot,
                "path": self.path,
                "app": self.app,
                "values": self.values,
                "index": self.index,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Pointer:
        """Parse and validate; a malformed pointer raises CorruptionError."""
        try:
            data = json.loads(text)
            ok = (
                isinstance(data, dict)
                and data.get("format") == FORMAT
                and data.get("version") == VERSION
                and all(isinstance(data.get(k), str) for k in ("store", "snapshot", "path"))
                and _ID.fullmatch(data["snapshot"]) is not None
                and data.get("values") in _VALUE_CODECS
                and all(data.get(k) is None or isinstance(data[k], str) for k in ("app", "index"))
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise CorruptionError(f"not a valid ckstore pointer: {str(text)[:200]!r}")
        return cls(
            data["store"],
            data["snapshot"],
            data["path"],
            data["app"],
            data["values"],
            data["index"],
        )

    @classmethod
    def to(cls, store: Store, snapshot: str, path: str, **kw: Any) -> Pointer:
        """A pointer to ``snapshot`` of ``store`` written at ``path`` (its index URL recorded,
        password hidden, only when it is not the store's default)."""
        index = store.index_url if store.opened_with.get("index") else None
        return cls(store.url, snapshot, path, index=index, **kw)


class _Call:
    """What ``torch.save`` pickles for a pointer: the call ``load_pointer(<JSON>)``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return load_pointer, (self.text,)


def saveable(pointer: Pointer) -> Any:
    """The object to ``torch.save`` (or hand to a trainer's file writer) at the pointer's path."""
    return _Call(pointer.to_json())


def to_bytes(pointer: Pointer) -> bytes:
    """The pointer file's bytes (a ``torch.save`` file)."""
    buffer = io.BytesIO()
    torch.save(saveable(pointer), buffer)
    return buffer.getvalue()


def load_pointer(text: str) -> Any:
    """What a pointer file loads as: the checkpoint it points to, read from its store.

    Called by ``torch.load`` for a pointer file (the file's only global). Raises
    CheckpointNotFoundError (a FileNotFoundError) if the snapshot is gone.
    """
    return resolve(Pointer.from_json(text))


def resolve(pointer: Pointer, store: Store | None = None) -> Any:
    """The checkpoint ``pointer`` stands for, read (verified) from ``store`` or the store it
    names (the open handle of this process if there is one, else opened read-only).

    Raises:
        CheckpointNotFoundError: the snapshot is no longer in the store.
    """
    if store is None:
        store = _store_of(pointer)
    try:
        snap = store.get(pointer.snapshot)
    except SnapshotNotFoundError:
        raise CheckpointNotFoundError(
            f"Checkpoint file not found: {pointer.path} points to snapshot "
            f"{pointer.snapshot[:12]} of store {pointer.store}, which is no longer there (it was "
            "deleted: the trainer removed or replaced the checkpoint at that path; a copy of a "
            "pointer file is not a copy of the checkpoint, tag the snapshot or `ckstore export` "
            "it to keep it); see `ckstore log` for what the store holds"
        ) from None
    if pointer.app is not None:
        obj: Any = snap.read_object(pointer.app)
    else:
        obj = {app: snap.read_object(app) for app in snap.manifest.apps if app != SOURCE_APP}
    return from_plain(obj) if pointer.values == "lightning" else obj


def _store_of(pointer: Pointer) -> Store:
    found = opened(pointer.store)
    if found is not None:
        return found
    index = pointer.index
    if index is not None and "***" in index:
        raise CheckpointNotFoundError(
            f"Checkpoint file not found: {pointer.path} is in store {pointer.store}, whose index "
            f"{index} needs a password the file does not hold; open the store first in this "
            "process (ckstore.open(url, index=...)) or load through the integration's plugin"
        )
    return StoreRef(pointer.store, index=index, read_only=True).get()


class _Peek(pickle.Unpickler):
    """Reads a pointer file's pickle without running it: :func:`load_pointer` becomes the JSON
    parser, every other global and any tensor storage stops the read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, load_pointer.__name__):
            return Pointer.from_json
        raise pickle.UnpicklingError(f"{module}.{name}: not a ckstore pointer")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a tensor storage: not a ckstore pointer")


def parse(data: bytes) -> Pointer | None:
    """The pointer in a file's bytes, or None when they are anything else (a real checkpoint,
    another small torch file)."""
    if len(data) > MAX_POINTER_BYTES or not data.startswith(b"PK"):
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            if len(names) != 1:
                return None
            found = _Peek(io.BytesIO(archive.read(names[0]))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, CorruptionError, EOFError, ValueError):
        return None
    except (TypeError, AttributeError, IndexError, KeyError, OverflowError):
        return None  # malformed pickle opcodes
    return found if isinstance(found, Pointer) else None


def read_file(path: str) -> Pointer | None:
    """The pointer at ``path`` (a local path or an fsspec URL; a symlink is followed), or None
    when there is no file, or a file that is no pointer."""
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    try:
        info = fs.info(inner)
        if info.get("type") != "file" or int(info.get("size") or 0) > MAX_POINTER_BYTES:
            return None
        with fs.open(inner, "rb") as f:
            data = f.read(MAX_POINTER_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return None
    return parse(data)


torch.serialization.add_safe_globals([load_pointer])
