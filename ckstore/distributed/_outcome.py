"""What a distributed take's commit did, when word of it did not reach every rank.

Rank 0 commits alone, then broadcasts the record. If it dies (or the group breaks) between the
two, the other ranks' commit phase fails, yet the snapshot may be committed: telling them the
take failed would be false, and a job restarted on that word would redo or distrust a good
checkpoint. The index decides instead. The commit ends the take's staging session in its own
transaction, after locking it; :meth:`~ckstore.index.Index.settle_session` aborts that session
unless it already ended, in one transaction too. So exactly one of the two happens first: a
rank that finds the session ``committed`` returns the snapshot (found by its own part, which
the snapshot references, and rank 0's session, which the root's header names); one that aborts
it raises its error, and a commit still on its way can no longer happen.
"""

from __future__ import annotations

import logging

from ..engine.repository import Repository
from ..engine.repository import describe as describe_record
from ..errors import CkstoreError, DistributedError
from ..format.parts import Root
from ..index import SnapshotRecord

log = logging.getLogger("ckstore")


def settled(
    repo: Repository,
    error: DistributedError,
    staged: str,
    owner: str,
    part_id: str,
    mine: SnapshotRecord | None,
) -> SnapshotRecord | None:
    """The snapshot this take committed although this rank's commit phase failed with
    ``error``, or None: nothing was committed, and nothing will be.

    Args:
        mine: what rank 0 committed itself (None: it did not, or this is another rank).
        staged: the take's staging session (rank 0's), ended ``committed`` by the commit.
        owner: rank 0's own session, which the committed root's header names.
        part_id: this rank's part of the manifest, which the committed snapshot references.
    """
    if mine is not None:
        _committed_anyway(mine, error)
        return mine
    try:
        if repo.index.settle_session(staged) != "committed":
            return None
        using = repo.index.snapshots_using([part_id]).get(part_id, set())
        for snapshot_id in sorted(using):
            record = repo.index.get_snapshot(snapshot_id)
            raw = repo.objects.get_blob("manifests", record.manifest_id)
            header = Root.from_json(raw, f"manifest of {snapshot_id[:12]}").snapshot or {}
            if header.get("session") == owner:
                _committed_anyway(record, error)
                return record
    except CkstoreError as exc:  # the index or the store cannot tell: the take's error stands
        log.warning("distributed take: could not tell whether the commit happened: %s", exc)
    return None


def _committed_anyway(record: SnapshotRecord, error: DistributedError) -> None:
    log.warning(
        "distributed take: %s is committed, though its commit phase failed: %s",
        describe_record(record),
        error,
    )
