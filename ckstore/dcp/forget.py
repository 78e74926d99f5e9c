"""A marked folder's retention as the store's: the steps a trainer removed leave the store.

torchtitan keeps ``keep_latest_k`` checkpoints by ``shutil.rmtree`` of the older ``step-N``
folders (from a thread, without telling anyone). :func:`forget_removed` finds the snapshots
those folders stood for and deletes them, then gives the space back (``store.gc()``: at
once when no other write session is alive, docs/RELIABILITY.md I4). The next save into the
folder runs it after its own commit; ``ckstore sync-folder`` runs it by hand.

A snapshot is deleted only when all of these hold (an integration never deletes what it did
not write):

- its metadata names this folder's marker (:data:`~ckstore.dcp.folder.METADATA_KEY`): it was
  saved through this very marker, not by another folder, run or plain ckstore calls;
- the marker still stands in the folder, unchanged, and the folder is where it was marked
  (a moved or copied folder deletes nothing until marked again; a re-created or re-marked
  folder has another identity);
- no pointer at its step folder names it any more: the folder is gone, or a later save of the
  same step replaced its pointer;
- it was committed before ``before`` (the saving writer's start), so a save still between its
  commit and its pointer write is never mistaken for a removed one;
- it is not tagged (a tag someone set keeps it; it is reported).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.lease import gone
from ..errors import ConflictError, CorruptionError, InvalidInputError, SnapshotNotFoundError
from ..store_ref import StoreRef
from .folder import METADATA_KEY, POINTER_NAME, Marker, StepPointer, read_marker, read_saving

if TYPE_CHECKING:
    from ..snapshot import StoredSnapshot
    from ..store import Store


@dataclass(frozen=True)
class ForgetReport:
    """What :func:`forget_removed` did.

    Attributes:
        folder: the marked folder.
        deleted: ids of the snapshots deleted (their step folders were removed).
        kept_tagged: ids of snapshots whose step folder was removed but that are tagged.
        purged_now: chunks given back at once by the gc that followed (0: none ran, or
            another write session was alive and the grace period applies).
        paused: why nothing was considered (the folder is not marked, or was moved or copied),
            else None.
    """

    folder: str
    deleted: tuple[str, ...] = ()
    kept_tagged: tuple[str, ...] = ()
    purged_now: int = 0
    paused: str | None = None


def forget_removed(
    folder: str | os.PathLike[str],
    store: Store | None = None,
    *,
    before: float | None = None,
    reclaim: bool = True,
) -> ForgetReport:
    """Delete the snapshots whose step folders were removed from the marked ``folder``.

    Args:
        folder: a folder marked with :func:`~ckstore.dcp.mark_folder`.
        store: an open handle of the marker's store (default: opened from the marker).
        before: only snapshots committed before this time (Unix seconds) are considered.
        reclaim: run ``store.gc()`` after deleting, so the space comes back within the job
            (False: the caller gives it back, e.g. ``store.reclaim_behind()``).

    Returns:
        What was deleted, kept, or why nothing was considered.

    Raises:
        InvalidInputError: ``store`` is not the store the folder is marked for.
        CorruptionError: the folder's marker file is damaged.
    """
    where = os.path.realpath(os.fspath(folder))
    marker = read_marker(where)
    paused = _paused(where, marker)
    if paused is not None or marker is None:
        return ForgetReport(where, paused=paused or "not marked")
    if store is None:
        store = StoreRef(marker.store, index=marker.index).get()
    elif store.url != marker.store:
        raise InvalidInputError(
            f"{where} is marked for store {marker.store}, not {store.url}: give that store"
        )
    snapshots = store.log(run=marker.run)
    # listed after the snapshots: a step committed by then had its save's session begun before.
    # A save whose lease ran out is expired first, in the index: a save stopped past its lease
    # before its pointer (SIGSTOP, a suspended host) checks its session after writing the
    # pointer, so either it sees the expiry and fails, or the pointer is read below.
    # A read-only store writes nothing (deleting fails there anyway): it judges by the clock.
    now = time.time()
    store.expire_sessions()
    live = {  # saves finishing a step (a session of a process gone from this host is not)
        h.session.id
        for h in store.sessions()
        if h.session.expires_at >= now and not gone(h.session.owner)
    }
    removed = [s for s in snapshots if _removed(s, where, marker, before, live)]
    deleted, tagged = [], []
    for snap in removed:
        if read_marker(where) != marker:  # re-marked or removed meanwhile: stop
            break
        try:
            store.delete(snap.id)
        except ConflictError:
            tagged.append(snap.id)
            continue
        except SnapshotNotFoundError:
            continue  # deleted meanwhile (another sync)
        deleted.append(snap.id)
    purged = store.gc().purged_now if deleted and reclaim else 0
    return ForgetReport(where, tuple(deleted), tuple(tagged), purged)


def _paused(where: str, marker: Marker | None) -> str | None:
    if marker is None:
        return f"{where} is not marked (no marker file)"
    if marker.folder != where:
        return (
            f"{where} holds the marker made for {marker.folder}: moved or copied; it deletes "
            "nothing until marked again (ckstore mark-folder)"
        )
    return None


def _removed(
    snap: StoredSnapshot, where: str, marker: Marker, before: float | None, live: set[str]
) -> bool:
    """True when ``snap`` was saved through ``marker`` and no pointer names it any more (nor
    will: no save holding one of the ``live`` write sessions is finishing its step)."""
    record = snap.metadata.get(METADATA_KEY)
    if not isinstance(record, dict) or record.get("marker") != marker.id:
        return False
    name = record.get("name")
    if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
        return False
    if before is not None and snap.created_at >= before:
        return False
    pointer_path = os.path.join(where, name, POINTER_NAME)
    try:
        with open(pointer_path, encoding="utf-8") as f:
            text = f.read(64 * 1024)
    except (FileNotFoundError, NotADirectoryError):  # the step folder (or its pointer) was
        return read_saving(os.path.join(where, name)) not in live  # removed, or is coming
    except (OSError, UnicodeDecodeError):
        return False  # unreadable: keep, in doubt
    try:
        pointer = StepPointer.from_json(text, pointer_path)
    except CorruptionError:
        return False  # not ours to judge: keep
    return pointer.marker == marker.id and pointer.snapshot != snap.id  # replaced by a newer save
