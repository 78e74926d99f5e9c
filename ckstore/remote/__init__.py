"""Remotes: push and pull snapshots between stores, clone a store, and the two-tier store.

The layer above the engine that moves snapshots between repositories (git's remote verbs for
tensors): :mod:`.config` keeps a store's remotes in its index, :mod:`.select` turns refs into
the snapshots and tags to send, :mod:`.copy` sends the chunks the other side lacks,
:mod:`.transfer` commits each snapshot there in the destination's crash order. The two-tier
store (``ckstore.open(..., push_to=...)``) adds :mod:`.uploader` (a background push after every
commit), :mod:`.tier` (reads of chunks the local tier evicted go to the remote) and
:mod:`.evict` (the local budget) with :mod:`.hydrate` (its inverse); :mod:`.heal` brings back
damaged local chunks from a remote that holds them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..engine.progress import ProgressFn
from . import config, heal, hydrate, twotier
from .select import Selection, select
from .transfer import TransferReport, transfer

if TYPE_CHECKING:
    from ..engine.interfaces import RemoteIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")

__all__ = [
    "Selection",
    "TransferReport",
    "config",
    "heal",
    "hydrate",
    "pull",
    "push",
    "select",
    "transfer",
    "twotier",
]


def push(
    local: Repository,
    name: str,
    refs: Sequence[str] = (),
    *,
    force: bool = False,
    pause: Callable[[], bool] | None = None,
    progress: ProgressFn | None = None,
) -> TransferReport:
    """Send the snapshots ``refs`` name (none: every run and tag) to remote ``name``, creating the
    remote store if there is none yet and the remote was never used (with this store's chunk,
    pack and inline sizes). From a read-only store everything is sent and nothing recorded here
    (``push_status`` unchanged).

    Raises:
        NotFoundError: no remote ``name``, or it was used and its store is missing (nothing is
            created); SnapshotNotFoundError: a ref names nothing here.
        ConflictError: the store at its URL is another one than recorded.
        CorruptionError, LeaseExpiredError: see :func:`.transfer.transfer`.
    """
    index: RemoteIndex = local.index
    local.write_backs.wait()  # healed chunks land before they are read to be sent
    remote = config.get(index, name)
    selection = select(index, refs)
    dst, created = config.open_or_create(index, remote, local)
    try:
        report = transfer(
            local,
            dst,
            selection,
            direction="push",
            remote=name,
            force=force,
            pause=pause,
            progress=progress,
            record=_recorder(index, local.read_only, name),
        )
    finally:
        dst.close()
    report.created = created
    return report


def _recorder(index: RemoteIndex, read_only: bool, name: str) -> Callable[[list[str]], None]:
    """How a push records what the remote holds: in this store's index, or (a read-only store,
    which writes nothing) not at all: everything is sent, and ``push_status`` stays as it was."""
    if read_only:
        return lambda ids: None
    return lambda ids: index.mark_pushed(name, ids)


def pull(
    local: Repository,
    name: str,
    refs: Sequence[str] = (),
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    source: Repository | None = None,
) -> TransferReport:
    """Bring the snapshots ``refs`` name at remote ``name`` (none: every run and tag) here.
    Of the snapshots ``refs`` name that are here already, the chunks whose local bytes are
    damaged are sent again (healed, :mod:`.heal`; ``chunks_healed``).
    ``source``: the remote's repository, open already (a clone's; left open), else it is opened.

    Raises:
        NotFoundError: no remote ``name``, or no store at its URL; SnapshotNotFoundError: a ref
            names nothing there.
        ConflictError: the store at its URL is another one than recorded.
        CorruptionError: a chunk or manifest of the remote is damaged (named); the snapshots
            that need it are not committed here, the others are.
    """
    index: RemoteIndex = local.index
    remote = config.get(index, name)
    src = source if source is not None else config.open_remote(index, remote)
    try:
        selection = select(src.index, refs)
        report = transfer(
            src,
            local,
            selection,
            direction="pull",
            remote=name,
            force=force,
            progress=progress,
            record=lambda ids: index.mark_pushed(name, ids),
        )
        if refs:
            _heal_present(local, name, selection, report)
        return report
    finally:
        if source is None:
            src.close()


def _heal_present(
    local: Repository, name: str, selection: Selection, report: TransferReport
) -> None:
    """The snapshots a pull named that were here already: their damaged local chunks are sent
    again from remote ``name`` (verified against their ids), so a pull of a snapshot whose
    local copy is damaged does not answer "nothing to send"."""
    present = [s.id for s in selection.snapshots if s.id not in report.snapshots_sent]
    index: RemoteIndex = local.index
    wanted: set[str] = set()
    for sid in present:
        wanted |= index.snapshot_chunk_ids(sid)
    bad = heal.damaged(local, wanted)
    if bad:
        healed = heal.heal(local, bad, name)
        report.chunks_healed = sorted(healed.healed)
        report.stats.count(chunks_sent=len(healed.healed))
        if healed.unrecoverable:
            log.warning(
                "pull from %r: %d damaged local chunk(s) the remote holds no sound copy of: %s",
                name,
                len(healed.unrecoverable),
                ", ".join(c[:16] for c in healed.unrecoverable[:8]),
            )
