"""Teach ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` the ``ckstore://`` checkpoint ids
and the folders marked for ckstore.

DCP chooses a storage layer from a bare ``checkpoint_id`` in one function,
``torch.distributed.checkpoint._storage_utils._storage_setup``, over a fixed list (its own
``FileSystemWriter``/``Reader``, then the fsspec ones): torch (2.13) has no registry a package
could add a layer to, and the fsspec layer would store DCP's own files. So :func:`install`
wraps that function where the saver and the loader call it: a ``ckstore://`` id (and only
that) with no storage object passed gets ckstore's :class:`~ckstore.dcp.StorageWriter` or
:class:`~ckstore.dcp.StorageReader` on the store it names; a plain path whose parent folder is
marked (:mod:`ckstore.dcp.folder`) gets a :class:`~ckstore.dcp.folder_writer.FolderWriter`, or
a reader of the snapshot its ``.metadata`` pointer names (a step folder holding a real DCP
checkpoint, saved before the folder was marked, is DCP's own to read); everything else goes to
DCP's own choice, unchanged. ``import ckstore.dcp`` installs it (idempotent).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointNotFoundError
from .folder import POINTER_NAME, locate, read_pointer
from .folder_writer import FolderWriter
from .reader import StorageReader
from .url import is_ckstore_id, parse
from .writer import StorageWriter

_WRAPPED = "__ckstore_wrapped__"


def storage_for(checkpoint_id: Any, reader: bool) -> StorageReader | StorageWriter:
    """The ckstore storage layer a ``ckstore://`` id names: a reader of its ref, or a writer of
    its run and step (the store is created by the first save, as DCP makes its folder)."""
    found = parse(checkpoint_id)
    if reader:
        return StorageReader(found.store, found.ref)
    run, step = found.run_step
    return StorageWriter(found.store, run=run, step=step)


def folder_storage(checkpoint_id: Any, reader: bool) -> StorageReader | StorageWriter | None:
    """The ckstore storage layer of a plain path in a marked folder, or None (not in one; or
    a real DCP checkpoint saved there before the folder was marked, for DCP's own reader).

    Raises:
        CheckpointNotFoundError: a load of a step folder that holds no pointer (never saved,
            removed, or a save that crashed before its pointer was written).
        CorruptionError: a damaged pointer.
    """
    at = locate(checkpoint_id)
    if at is None:
        return None
    if not reader:
        return FolderWriter(at)
    pointer = read_pointer(at.path)
    if pointer is not None:
        return StorageReader(pointer.store, pointer.snapshot, index=pointer.index)
    if os.path.exists(os.path.join(at.path, POINTER_NAME)):
        return None
    raise CheckpointNotFoundError(
        f"Checkpoint not found: {at.path} holds no {POINTER_NAME} (the step was never saved, "
        f"was removed, or its save did not finish); list {at.folder} for the steps it holds"
    )


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _storage_setup(storage: Any, checkpoint_id: Any, reader: bool = False) -> Any:
        if not storage and checkpoint_id is not None:
            if is_ckstore_id(checkpoint_id):
                return storage_for(checkpoint_id, reader)
            found = folder_storage(checkpoint_id, reader)
            if found is not None:
                return found
        return original(storage, checkpoint_id, reader)

    setattr(_storage_setup, _WRAPPED, True)
    return _storage_setup


def install() -> None:
    """Make DCP's saver and loader pick ckstore for ``ckstore://`` ids and paths in marked
    folders (idempotent)."""
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    for module in (state_dict_saver, state_dict_loader):
        current = getattr(module, "_storage_setup", None)
        if current is not None and not getattr(current, _WRAPPED, False):
            module._storage_setup = _wrap(current)  # type: ignore[attr-defined]
