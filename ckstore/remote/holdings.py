"""What a tier remote holds, shown before the local tier lets go of anything on its word.

Retention (``gc``) drops a snapshot of a two-tier store only once its tier remote holds it:
the remote's copy is then the durable one. The record here (``mark_pushed``) is this store's
word, written when the push committed; the remote may have lost the snapshot since (its
index restored from a backup, an asynchronous replica promoted, the store at its URL replaced).
So before a gc forgets anything (docs/RELIABILITY.md, I7):

- the tier remote is opened and shown to be the store it was (:func:`.config.open_remote`);
- every snapshot recorded as held there must be in its index: one it lost is forgotten here
  (``unmark_pushed``: ``pushing`` again, the uploader sends it again) and kept;
- a tier remote that cannot be opened or is another store now keeps every snapshot recorded
  as held there (nothing is dropped on its word until it is back).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import CkstoreError
from .config import open_remote

if TYPE_CHECKING:
    from ..engine.interfaces import ProofIndex, TierIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")


def lost_by(local: Repository, remote: Repository, name: str, forget: bool = True) -> set[str]:
    """Ids of the snapshots this store records as held by remote ``name`` (open as ``remote``)
    that its index lacks; with ``forget`` they are forgotten here (pushed again).

    Raises:
        StorageError, IndexError_: either index cannot be read.
    """
    index: TierIndex = local.index
    theirs: ProofIndex = remote.index
    held = index.held_by(name)
    lost = held - theirs.snapshot_ids(held)
    if lost and forget:
        log.warning(
            "ckstore: remote %r (%s) lacks %d snapshot(s) this store recorded as pushed there "
            "(its index lost them: a restore, a failover); they are pushed again",
            name,
            remote.url,
            len(lost),
        )
        index.unmark_pushed(name, lost)
    return lost


def unproven(local: Repository, forget: bool = True) -> set[str]:
    """Ids of the snapshots recorded as held by a tier remote that the remote was not shown to
    hold now (module docstring): what retention must keep besides what no tier holds yet.
    ``forget`` (False for a dry run) forgets the ones a remote's index lacks."""
    index: TierIndex = local.index
    out: set[str] = set()
    for record in index.list_remotes():
        held = index.held_by(record.name) if record.tier else set()
        if not held:
            continue
        try:
            remote = open_remote(index, record)  # the store it was, or an error
            try:
                out |= lost_by(local, remote, record.name, forget=forget)
            finally:
                remote.close()
        except CkstoreError as exc:
            log.warning(
                "ckstore: gc keeps the %d snapshot(s) recorded as pushed to tier remote %r: it "
                "cannot show it holds them (%s)",
                len(held),
                record.name,
                exc,
            )
            out |= held
    return out
