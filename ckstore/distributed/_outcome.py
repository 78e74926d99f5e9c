"""What a distributed take's commit did, when word of it did not reach every rank.

Rank 0 commits alone, then broadcasts the record. If it dies (or the group breaks) between the
two, the other ranks' commit phase fails, yet the snapshot may be committed: telling them the
take failed would be false, and a job restarted on that word would redo or distrust a good
checkpoint. The index decides instead. The commit ends the take's staging session in its own
transaction, after locking it; :meth:`~ckstore.index.Index.settle_session` aborts that session
unless it already ended, in one transaction too, and a session's final state is never
overwritten. So exactly one of the two happens first: a rank that finds the session
``committed`` returns the snapshot (found by its own part, which the snapshot references, and
rank 0's session, which the root's header names); one that aborts it raises its error, and a
commit still on its way can no longer happen. A rank the index does not answer (for
:data:`SETTLE_SECONDS`) raises :class:`~ckstore.errors.CommitUnknownError`, never "failed":
the commit may have happened, or may still happen while rank 0 lives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..engine.repository import Repository
from ..engine.repository import describe as describe_record
from ..errors import CkstoreError, CommitUnknownError, DistributedError
from ..format.parts import Root
from ..index import SnapshotRecord

log = logging.getLogger("ckstore")

SETTLE_SECONDS = 60.0
"""How long a rank retries an index that does not answer its settle (a lock held by a
commit under way, a network blip) before it says the outcome is unknown."""


def settled(
    repo: Repository,
    error: DistributedError,
    staged: str,
    owner: str,
    part_id: str,
    run: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> SnapshotRecord | None:
    """The snapshot this take committed although this rank's commit phase failed with
    ``error``, or None: nothing was committed, and nothing will be.

    Args:
        staged: the take's staging session (rank 0's), ended ``committed`` by the commit.
        owner: rank 0's own session, which the committed root's header names.
        part_id: this rank's part of the manifest, which the committed snapshot references.
        run: the take's run (the snapshot is one of its).

    Raises:
        CommitUnknownError: the index did not answer for :data:`SETTLE_SECONDS`.
    """
    state = _settle(repo, staged, error, sleep)
    if state != "committed":
        return None
    try:
        found = _find(repo, owner, part_id, run)
    except CkstoreError as exc:
        raise _unknown(error, f"its snapshot could not be read back: {exc}") from error
    if found is None:  # committed, but not found: deleted since (retention, a user)
        raise _unknown(error, "the commit happened, but its snapshot is no longer in the store")
    log.warning(
        "distributed take: %s is committed, though its commit phase failed: %s",
        describe_record(found),
        error,
    )
    return found


def _settle(
    repo: Repository, staged: str, error: DistributedError, sleep: Callable[[float], None]
) -> str | None:
    deadline = time.monotonic() + SETTLE_SECONDS
    pause = 0.1
    while True:
        try:
            return repo.index.settle_session(staged)
        except CkstoreError as exc:
            if time.monotonic() + pause > deadline:
                raise _unknown(error, f"the index did not answer: {exc}") from error
            log.warning("distributed take: asking the index what the commit did: %s", exc)
            sleep(pause)
            pause = min(2 * pause, 5.0)


def _find(repo: Repository, owner: str, part_id: str, run: str) -> SnapshotRecord | None:
    """The snapshot of ``run`` that references ``part_id`` and whose root names ``owner``,
    newest first (a part repeats in every take of a rank whose state did not change)."""
    using = repo.index.snapshots_using([part_id]).get(part_id, set())
    records = [repo.index.get_snapshot(i) for i in using]
    for record in sorted(
        (r for r in records if r.run == run), key=lambda r: r.created_at, reverse=True
    ):
        raw = repo.objects.get_blob("manifests", record.manifest_id)
        header = Root.from_json(raw, f"manifest of {record.id[:12]}").snapshot or {}
        if header.get("session") == owner:
            return record
    return None


def _unknown(error: DistributedError, why: str) -> CommitUnknownError:
    return CommitUnknownError(
        f"{error}; whether the take was committed is unknown ({why}): its snapshot may be "
        "in the store, or be committed yet while rank 0 lives; `ckstore log RUN` tells",
        ranks=error.ranks,
        causes=error.causes,
    )
