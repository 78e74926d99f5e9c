"""From a TorchSnapshot-style path to a store and a snapshot name inside it.

A local path inside an existing store (a parent directory holding ``ckstore.json``) names a
snapshot of that store. A take at any other path creates a store: for a step-like path (its
last part ends in a number: ``step_100``, ``epoch-3``, ``500``) whose parent folder is missing,
empty or holds only other ckstore stores, the store goes in the parent and the path names a
snapshot in it, so unchanged TorchSnapshot code that takes ``.../step_N`` every N steps gets
one store whose steps dedup against each other (:func:`shared_parent`;
``CKSTORE_SHARED_PARENT=0`` turns it off); otherwise the path is a store of its own.
``fs://`` (TorchSnapshot's file-system prefix) and ``file://`` paths are local; other URLs
(``s3://``, ``memory://``) are stores.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from .distributed import is_distributed
from .engine.config import CONFIG_NAME
from .engine.opening import is_local, local_path, open_repository
from .engine.repository import Repository
from .errors import SnapshotNotFoundError
from .history.auto_compact import attach as attach_compaction
from .index import SnapshotRecord

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def locate(
    path: str, storage_options: dict[str, Any] | None, index: str | None, create: bool
) -> tuple[Repository, str | None]:
    """The store holding ``path`` and the snapshot name inside it (None: the store root),
    with background compaction after takes (``ckstore.history.auto_compact.attach``)."""
    repo, name = _locate(path, storage_options, index, create)
    attach_compaction(repo)
    return repo, name


def _locate(
    path: str, storage_options: dict[str, Any] | None, index: str | None, create: bool
) -> tuple[Repository, str | None]:
    if not is_local(path):
        return open_repository(
            path, index=index, storage_options=storage_options, create=create
        ), None
    path = local_path(path)
    d = path
    while True:
        if os.path.isfile(os.path.join(d, CONFIG_NAME)):
            name = os.path.relpath(path, d).replace(os.sep, "/")
            return open_repository(d, index=index, create=False), None if name == "." else name
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not create:
        raise SnapshotNotFoundError(
            f"no ckstore snapshot at {path!r} (no store in it or its parents)"
        )
    shared = shared_parent(path)
    if shared is not None:
        return open_repository(shared, index=index, create=True), os.path.basename(path)
    return open_repository(path, index=index, storage_options=storage_options, create=True), None


SHARED_PARENT_ENV = "CKSTORE_SHARED_PARENT"
"""Set to 0 to give every new TorchSnapshot-style path a store of its own."""
_STEP_LIKE = re.compile(r".*[0-9]")


def shared_parent(path: str) -> str | None:
    """The folder above step-like ``path`` to create the shared store in, or None.

    Only when ``path``'s last part ends in a digit, and its parent is missing, empty, or
    holds nothing but ckstore stores (steps taken by an earlier ckstore, a store each): a
    folder with anything else in it is never made into a store.
    """
    if os.environ.get(SHARED_PARENT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    parent, name = os.path.split(path)
    if not _STEP_LIKE.fullmatch(name) or not parent or os.path.dirname(parent) == parent:
        return None
    if not os.path.exists(parent):
        return parent
    if not os.path.isdir(parent):
        return None
    for entry in os.scandir(parent):
        if not (entry.is_dir() and os.path.isfile(os.path.join(entry.path, CONFIG_NAME))):
            return None
    return parent


def locate_all_ranks(
    path: str,
    storage_options: dict[str, Any] | None,
    index: str | None,
    pg: ProcessGroup | None = None,
    timeout: float | None = None,
) -> tuple[Repository, str | None]:
    """Like ``locate(create=True)``; distributed, the group's rank 0 creates the store first.

    Only the members of ``pg`` take part (a bounded broadcast over their own group).
    """
    if not is_distributed():
        return locate(path, storage_options, index, create=True)
    from .distributed.comm import Comm, phase

    comm = Comm(pg, timeout)
    found = None
    with phase(comm, "opening the store", f"opening {path!r}", root=0):
        if comm.rank == 0:
            found = locate(path, storage_options, index, create=True)
    return found if found is not None else locate(path, storage_options, index, create=False)


def resolve(repo: Repository, name: str | None) -> SnapshotRecord:
    """The snapshot taken at the path named ``name`` (its name, and nothing else a ref could
    mean: a tag, a run or an id prefix of the same spelling would open another snapshot), or
    the store's latest when ``name`` is None (the path is the store's root).

    Raises:
        SnapshotNotFoundError: no snapshot was taken at that path (the message names it).
    """
    if name:
        try:
            return repo.index.snapshot_named(name)
        except SnapshotNotFoundError:
            raise SnapshotNotFoundError(
                f"no snapshot was taken at {name!r} in store {repo.url}; list them with "
                f"`ckstore log --store {repo.url}`"
            ) from None
    records = repo.index.list_snapshots(limit=1)
    if not records:
        raise SnapshotNotFoundError(f"store {repo.url} holds no snapshot yet")
    return records[0]
