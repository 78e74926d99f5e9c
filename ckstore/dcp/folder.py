"""Marked folders: a plain checkpoint folder whose ``step-N`` saves go into a ckstore store.

A trainer that knows nothing of ckstore (torchtitan) saves with
``dcp.save(state, checkpoint_id=os.path.join(folder, f"step-{n}"))``, finds the step to
resume with ``os.listdir(folder)`` and ``os.path.isfile(<step>/.metadata)``, purges with
``shutil.rmtree(<step>)`` and loads by the same path. :func:`mark_folder` marks ``folder``
once for a store and a run by writing a small marker file in it (:data:`MARKER_NAME`, JSON).
From then on, in a process where :mod:`ckstore.dcp` is imported (``python -m
ckstore.dcp.launch``), a checkpoint id whose parent is a marked folder selects ckstore:

- a save becomes one snapshot of the marker's run at step ``N`` (from the folder name
  ``step-N``; another name saves without a step), recording the marker's identity and the
  step folder's name in its metadata (:data:`METADATA_KEY`); only after the snapshot commits
  does the writer create ``step-N/`` with a pointer file ``step-N/.metadata`` (JSON,
  :class:`StepPointer`, written to a temporary name and renamed), so the trainer never lists a
  step the store does not hold;
- a load reads ``step-N/.metadata`` and loads the snapshot it names, by id (a tag moved since
  cannot change what a step means);
- a ``step-N`` folder the trainer removed is learned by the next save into the folder, which
  deletes that step's snapshot (:mod:`ckstore.dcp.forget`).

The pointer is JSON, never pickle: nothing of ckstore unpickles it, and DCP's own
``FileSystemReader`` (a process without ckstore) fails on its first byte
(``UnpicklingError: invalid load key, '{'``) instead of loading anything; its ``"note"``
says how to load it.

The marker's name, :data:`MARKER_NAME`, matches ``step-(\\d+)`` on purpose, as step 0: the
purge of torchtitan's releases before it filtered names (and of trainers copied from them)
calls ``int(re.search(r"step-(\\d+)", name).group(1))`` on every name in the folder, and
crashed on a name without a step. With step 0 the marker is the oldest entry, so such a purge
queues it first for ``shutil.rmtree(path, ignore_errors=True)``, which fails on a file and
leaves it (the marker takes the place of one of the removed entries, so the steps kept are
the same); the listing of steps to resume needs ``<name>/.metadata``, which a file never has.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ..engine.files import write_atomic
from ..errors import ConflictError, CorruptionError, InvalidInputError

MARKER_NAME = ".ckstore-folder.step-0.json"
"""The marker file's name inside a marked folder (why it reads as step 0: the module
docstring)."""
POINTER_NAME = ".metadata"

SAVING_NAME = ".ckstore-saving.json"
"""In a step folder while a save of it runs from before its commit until its pointer is written:
the write session that holds the save's place (a save beside it must not take the step for a
removed one in between)."""
"""The pointer file's name inside a step folder (the file DCP and torchtitan look for)."""
METADATA_KEY = "dcp_folder"
"""The snapshot metadata key recording ``{"marker": <id>, "name": <step folder name>, "path":
<its absolute path at save time>}``: which marked folder's pointer stands for the snapshot."""
MAX_FILE_BYTES = 64 * 1024
"""A marker or pointer file larger than this is refused (not ours)."""
NOTE = (
    "This step is a snapshot in a ckstore store, not a DCP checkpoint folder: load it with "
    "dcp.load in a process where ckstore.dcp is imported (python -m ckstore.dcp.launch ...)."
)
_MARKER_FORMAT, _POINTER_FORMAT, _VERSION = "ckstore-dcp-folder", "ckstore-dcp-step", 1
_STEP = re.compile(r"step-(\d+)")
_ID = re.compile(r"[0-9a-f]{16,128}")


@dataclass(frozen=True)
class Marker:
    """What a marker file says.

    Attributes:
        id: the marker's identity (random, made when the folder is marked): snapshots record
            it, and only a folder holding this same marker deletes them.
        store: the store's URL.
        run: the run every save into the folder belongs to.
        folder: the folder's absolute real path when it was marked (a folder found elsewhere
            was moved or copied: it deletes nothing until marked again).
        index: the index URL when it is not the store's default (a password is never written).
    """

    id: str
    store: str
    run: str
    folder: str
    index: str | None = None

    def to_json(self) -> str:
        return json.dumps({"format": _MARKER_FORMAT, "version": _VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, text: str, where: str) -> Marker:
        """Parse and validate a marker file's text (``where`` names it in errors).

        Raises:
            CorruptionError: not a valid marker.
        """
        data = _document(text, _MARKER_FORMAT, where)
        fields = ("id", "store", "run", "folder")
        if not all(isinstance(data.get(k), str) and data[k] for k in fields) or not _ID.fullmatch(
            data["id"]
        ):
            raise CorruptionError(f"{where}: not a valid ckstore folder marker; mark it again")
        index = data.get("index")
        if index is not None and not isinstance(index, str):
            raise CorruptionError(f"{where}: not a valid ckstore folder marker; mark it again")
        return cls(data["id"], data["store"], data["run"], data["folder"], index)


@dataclass(frozen=True)
class StepPointer:
    """What a step folder's ``.metadata`` pointer says.

    Attributes:
        store: the store's URL.
        snapshot: the snapshot's full id (loads read exactly this snapshot).
        marker: the identity of the marker the step was saved under.
        name: the step folder's name (``step-N``).
        index: the index URL when it is not the store's default.
    """

    store: str
    snapshot: str
    marker: str
    name: str
    index: str | None = None

    def to_json(self) -> str:
        body = {"format": _POINTER_FORMAT, "version": _VERSION, **asdict(self), "note": NOTE}
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> StepPointer:
        """Parse and validate a pointer file's text.

        Raises:
            CorruptionError: not a valid pointer.
        """
        data = _document(text, _POINTER_FORMAT, where)
        ok = all(isinstance(data.get(k), str) for k in ("store", "snapshot", "marker", "name"))
        ok = ok and bool(_ID.fullmatch(str(data.get("snapshot"))))
        if not ok or not (data.get("index") is None or isinstance(data["index"], str)):
            raise CorruptionError(f"{where}: not a valid ckstore step pointer")
        return cls(data["store"], data["snapshot"], data["marker"], data["name"], data["index"])


@dataclass(frozen=True)
class MarkedStep:
    """A checkpoint id inside a marked folder: the folder, its marker and the step folder."""

    folder: str
    marker: Marker
    name: str

    @property
    def path(self) -> str:
        """The step folder's path."""
        return os.path.join(self.folder, self.name)

    @property
    def step(self) -> int | None:
        """``N`` for a folder named ``step-N``, else None."""
        m = _STEP.fullmatch(self.name)
        return int(m[1]) if m else None


def mark_folder(
    folder: str | os.PathLike[str],
    store: str | os.PathLike[str],
    run: str | None = None,
    *,
    index: str | None = None,
    replace: bool = False,
) -> Marker:
    """Mark ``folder`` so that DCP saves of ``<folder>/step-N`` go into ``store`` as ``run@N``.

    Creates the folder if needed and writes its marker (atomically). Marking again with the
    same store and run keeps the marker (and its identity) as it is; a folder that was moved
    keeps its identity and learns its new place; a copy of a marked folder gets a new
    identity (so neither copy deletes the other's snapshots). The store is created at the
    first save if it does not exist.

    Args:
        folder: the trainer's checkpoint folder (torchtitan's ``checkpoint.folder``).
        store: the store's URL (a local path, ``s3://...``).
        run: the run the saves belong to (default: the folder's name).
        index: the index URL when it is not the store's default (kept in the marker; one
            that needs a password must come from the environment instead).
        replace: re-mark a folder marked for another store or run. The old marker's
            snapshots stay in their store and are never deleted through this folder.

    Returns:
        The folder's marker.

    Raises:
        ConflictError: the folder is marked for another store or run and ``replace`` is False.
        InvalidInputError: an index URL that holds a password.
    """
    where = os.path.realpath(os.fspath(folder))
    url = os.fspath(store)
    url = os.path.abspath(url) if "://" not in url else url
    if index is not None and re.search(r"://[^/@]*:[^/@]*@", index):
        raise InvalidInputError(
            f"marking {where}: the index URL holds a password, which a marker file must not "
            "hold; give the password through the environment (e.g. PGPASSWORD) and mark again"
        )
    name = run if run is not None else os.path.basename(where)
    old = read_marker(where)
    same = old is not None and (old.store, old.run, old.index) == (url, name, index)
    if old is not None and same and not replace:
        if old.folder == where:
            return old  # marked as asked already
        if not _still_marked(old):  # moved here: the same folder, its identity kept
            moved = Marker(old.id, url, name, where, index)
            write_atomic(os.path.join(where, MARKER_NAME), moved.to_json())
            return moved
    elif old is not None and not replace:
        raise ConflictError(
            f"{where} is already marked for run {old.run!r} of store {old.store}: pass "
            f"replace=True (ckstore mark-folder --replace) to mark it for run {name!r} of "
            f"{url}; the old marker's snapshots then stay in their store untouched"
        )
    marker = Marker(uuid.uuid4().hex, url, name, where, index)
    os.makedirs(where, exist_ok=True)
    write_atomic(os.path.join(where, MARKER_NAME), marker.to_json())
    return marker


def read_marker(folder: str) -> Marker | None:
    """The marker of ``folder``, or None when it has none.

    Raises:
        CorruptionError: a marker file that is not valid.
    """
    text = _read_small(os.path.join(folder, MARKER_NAME))
    return None if text is None else Marker.from_json(text, os.path.join(folder, MARKER_NAME))


def read_pointer(step_folder: str) -> StepPointer | None:
    """The pointer in ``step_folder/.metadata``, or None when there is no such file or it is
    no JSON (a real DCP checkpoint's metadata, a pickle). Never unpickles anything.

    Raises:
        CorruptionError: a JSON file that is not a valid pointer.
    """
    path = os.path.join(step_folder, POINTER_NAME)
    text = _read_small(path)
    if text is None or not text.lstrip().startswith("{"):
        return None
    return StepPointer.from_json(text, path)


def locate(checkpoint_id: Any) -> MarkedStep | None:
    """The marked step a plain-path checkpoint id names, or None (not a local path, or its
    parent folder is not marked). Costs one ``stat`` for an unmarked folder."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return None
    path = os.fspath(checkpoint_id)
    if not isinstance(path, str) or not path or "://" in path:
        return None
    parent, name = os.path.split(os.path.abspath(path))
    if not name or not os.path.isfile(os.path.join(parent, MARKER_NAME)):
        return None
    marker = read_marker(parent)
    return MarkedStep(parent, marker, name) if marker is not None else None


def write_pointer(at: MarkedStep, pointer: StepPointer) -> None:
    """Create the step folder and write its pointer atomically (temporary file, fsync, rename)."""
    os.makedirs(at.path, exist_ok=True)
    write_atomic(os.path.join(at.path, POINTER_NAME), pointer.to_json())


def write_saving(at: MarkedStep, session_id: str) -> None:
    """Create the step folder and say, atomically, that write session ``session_id`` is saving
    it (:data:`SAVING_NAME`)."""
    os.makedirs(at.path, exist_ok=True)
    write_atomic(os.path.join(at.path, SAVING_NAME), json.dumps({"session": session_id}).encode())


def clear_saving(at: MarkedStep) -> None:
    """Remove the step folder's :data:`SAVING_NAME` (idempotent)."""
    try:
        os.unlink(os.path.join(at.path, SAVING_NAME))
    except FileNotFoundError:
        pass


def read_saving(step_folder: str) -> str | None:
    """The write session a step folder says is saving it, or None (none, or unreadable)."""
    text = _read_small(os.path.join(step_folder, SAVING_NAME))
    try:
        session = json.loads(text)["session"] if text is not None else None
    except (ValueError, TypeError, KeyError):
        return None
    return session if isinstance(session, str) else None


def _still_marked(marker: Marker) -> bool:
    """Whether the folder ``marker`` was made for still holds it (a copy's original)."""
    try:
        return read_marker(marker.folder) == marker
    except CorruptionError:
        return False


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _document(text: str, fmt: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise CorruptionError(f"{where}: not a {fmt} file")
    if data.get("version") != _VERSION:
        raise CorruptionError(
            f"{where}: {fmt} version {data.get('version')!r}; this ckstore reads version "
            f"{_VERSION}: upgrade ckstore"
        )
    return data
