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
  as held there (nothing is dropped on its word until it is back);
- and once retention chose what to drop, each such snapshot held by a tier remote is shown to
  be there in fact (:func:`unshown`: its manifest read there and hashed; its chunks in the
  remote's index, every remote pack they lie in of its recorded size, a sample read back and
  checked, as an eviction does): a remote whose manifests or packs were cut short or lost
  keeps the snapshot here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from ..errors import CkstoreError, CorruptionError, ObjectNotFoundError
from .config import open_remote
from .proof import Proof

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
    return _per_tier(
        local, None, lambda remote, name, held: lost_by(local, remote, name, forget=forget)
    )


def unshown(local: Repository, snapshot_ids: Collection[str]) -> set[str]:
    """Of ``snapshot_ids`` (what a gc is about to drop), those a tier remote is recorded to
    hold but was not shown to hold in fact (module docstring): what the gc must keep."""
    return _per_tier(
        local, set(snapshot_ids), lambda remote, name, held: _unshown_at(local, remote, name, held)
    )


def _per_tier(
    local: Repository,
    among: set[str] | None,
    check: Callable[[Repository, str, set[str]], set[str]],
) -> set[str]:
    """Union over the tier remotes of ``check(remote, name, held)``: ``held`` the snapshots
    (of ``among``; None: all) recorded as held there. A remote that cannot be opened, or
    whose check fails, keeps every one of them."""
    index: TierIndex = local.index
    out: set[str] = set()
    for record in index.list_remotes():
        held = index.held_by(record.name) if record.tier else set()
        held = held if among is None else held & among
        if not held:
            continue
        try:
            remote = open_remote(index, record)  # the store it was, or an error
            try:
                out |= check(remote, record.name, held)
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


def _unshown_at(local: Repository, remote: Repository, name: str, held: set[str]) -> set[str]:
    proof = Proof(remote)
    index: TierIndex = local.index
    theirs: ProofIndex = remote.index
    out = set()
    for snapshot_id in sorted(held):
        ids = sorted(index.snapshot_chunk_ids(snapshot_id))
        found = theirs.chunk_locations(ids)
        whole = not any(i not in found for i in ids) and proof.holds(found, ids)
        if not whole or not _manifest_there(local, remote, snapshot_id):
            log.warning(
                "ckstore: gc keeps snapshot %s: tier remote %r (%s) is recorded to hold it, but "
                "its manifest or packs there are missing, cut short or damaged",
                snapshot_id[:12],
                name,
                remote.url,
            )
            out.add(snapshot_id)
    return out


def _manifest_there(local: Repository, remote: Repository, snapshot_id: str) -> bool:
    """Whether the remote holds the snapshot's manifest, whole (read, hashed against its id)."""
    index: TierIndex = local.index
    manifest_id = index.get_snapshot(snapshot_id).manifest_id
    try:
        remote.objects.get_blob("manifests", manifest_id)
    except (CorruptionError, ObjectNotFoundError) as exc:
        log.warning("ckstore: manifest %s at the remote: %s", manifest_id[:12], exc)
        return False
    return True
