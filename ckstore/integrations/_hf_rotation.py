"""The Trainer's ``save_total_limit`` over the snapshots of folders that no longer exist.

With ``keep_local=False`` the Hugging Face callback deletes each checkpoint folder once it is
imported, so the Trainer's own rotation, which lists the ``checkpoint-*`` folders of
``output_dir``, never sees them and never rotates. Here the Trainer's rule
(``transformers.trainer_utils.rotate_checkpoints``, and the ``save_total_limit == 1`` case at
the end of ``Trainer.train``) runs over the snapshots such a callback imported from that
``output_dir`` instead, as if their folders were still there:

- the checkpoints are ordered by when they were saved (the Trainer orders folders by their
  mtime), oldest first; the newest and the best one are protected;
- the oldest unprotected ones go until ``max(save_total_limit, protected)`` remain;
- at the end of training with ``save_total_limit == 1`` and a best checkpoint, every other
  one goes, the newest included.

Which snapshots count is read from the store alone, so a relaunch in a new process continues
the rotation over the previous process's snapshots: see :func:`imported_from`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._paths import identity, path_tag, tag_prefix

if TYPE_CHECKING:
    from ..store import Store

DELETED_FOLDERS = "none"
"""The ``hf.local`` metadata of a snapshot whose folder the callback deleted (``keep_local=False``)."""
_FOLDER = re.compile(r"checkpoint-([0-9]+)")


@dataclass(frozen=True)
class Imported:
    """One checkpoint of ``output_dir`` that lives in the store alone.

    Attributes:
        id: the snapshot's id.
        folder: the folder it was imported from (an :func:`~._paths.identity`).
        saved_at: when it was taken (Unix time).
        step: the number in the folder's name.
    """

    id: str
    folder: str
    saved_at: float
    step: int


def imported_from(store: Store, run: str, output_dir: str) -> list[Imported]:
    """The snapshots of ``run`` a ``keep_local=False`` callback imported from the
    ``checkpoint-<step>`` folders of ``output_dir``, oldest save first.

    A snapshot counts only when all of these hold, so that no snapshot of another run, another
    ``output_dir``, another ``keep_local`` mode, or one that someone else tagged with such a
    name is ever counted: its path tag (``<run>/<folder digest>/checkpoint-<step>``) points at
    it; its ``hf`` metadata records that very folder, directly in ``output_dir``, and the mode
    ``"none"``; it belongs to ``run``.
    """
    here = os.path.dirname(identity(os.path.join(output_dir, "checkpoint-0")))
    prefix = tag_prefix(run, here)
    found = [
        imported
        for name, sid in store.tags().items()
        if name.startswith(prefix) and (imported := _counted(store, run, here, name, sid))
    ]
    return sorted(found, key=lambda c: (c.saved_at, c.step))


def _counted(store: Store, run: str, here: str, tag: str, sid: str) -> Imported | None:
    """Snapshot ``sid`` as one of :func:`imported_from`'s, if it is one (``tag``: its path
    tag; ``here``: the identity of ``output_dir``)."""
    snap = store.get(sid, None)
    meta = snap.metadata.get("hf") if snap is not None else None
    if snap is None or snap.run != run or not isinstance(meta, dict):
        return None
    folder = meta.get("folder")
    if not isinstance(folder, str) or meta.get("local") != DELETED_FOLDERS:
        return None
    match = _FOLDER.fullmatch(os.path.basename(folder))
    if match is None or os.path.dirname(folder) != here or path_tag(run, folder) != tag:
        return None
    return Imported(sid, folder, snap.created_at, int(match.group(1)))


def rotated_out(
    checkpoints: Sequence[Imported], limit: int | None, best: str | None, at_end: bool
) -> list[Imported]:
    """Which of ``checkpoints`` (oldest save first) the Trainer's rotation deletes.

    Args:
        checkpoints: from :func:`imported_from`.
        limit: ``save_total_limit`` (None or <= 0: keep every checkpoint).
        best: the folder identity of the best checkpoint (never deleted), or None.
        at_end: the end of training, where ``save_total_limit == 1`` keeps the best checkpoint
            alone when there is one.

    Returns:
        The checkpoints to delete, oldest first.
    """
    if limit is None or limit <= 0 or not checkpoints:
        return []
    if at_end and limit == 1 and best in {c.folder for c in checkpoints}:
        return [c for c in checkpoints if c.folder != best]
    protected = {checkpoints[-1].folder} | ({best} if best else set())
    keep = max(limit, len(protected))
    gone: list[Imported] = []
    for c in checkpoints:
        if len(checkpoints) - len(gone) <= keep:
            break
        if c.folder not in protected:
            gone.append(c)
    return gone
