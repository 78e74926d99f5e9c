"""A commit whose chunk references come partly from a staging session's pins (what the ranks
of a distributed take pin there, docs/FORMAT.md section 9): copied in the commit's one
transaction, the staging session checked live and ended with it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import update

from ckstore.errors import LeaseExpiredError, NotFoundError
from ckstore.index import Index, _sql

from .helpers import ENTRIES, add_chunks, cid, snapshot


@pytest.fixture
def ix(index_url: str) -> Iterator[Index]:
    index = Index.open(index_url)
    yield index
    index.close()


def _staged(ix: Index) -> tuple[str, str, list[str], list[str]]:
    """A take's session and a staging session: chunks the first names, chunks pinned to the
    second (one in both)."""
    take = ix.begin_session("rank0", 30).id
    staging = ix.begin_session("rank0", 30).id
    own = add_chunks(ix, take, "p0", ["root-a", "both"])
    other = ix.begin_session("rank1", 30).id
    parts = add_chunks(ix, other, "p1", ["part-1", "piece-1", "piece-2"])
    assert set(ix.lookup_chunks(staging, parts + [cid("both")])) == {*parts, cid("both")}
    return take, staging, own, parts


def test_the_staging_pins_become_references(ix: Index) -> None:
    take, staging, own, parts = _staged(ix)
    rec = ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10, staged=staging)
    assert ix.snapshot_chunk_ids(rec.id) == {*own, *parts}
    with pytest.raises(LeaseExpiredError, match="committed"):  # ended with the commit
        ix.lookup_chunks(staging, parts)


def test_an_expired_staging_session_commits_nothing(ix: Index) -> None:
    take, staging, own, _ = _staged(ix)
    with ix._write("expire") as conn:  # noqa: SLF001 - the lease ran out meanwhile
        conn.execute(
            update(_sql.sessions)
            .where(_sql.sessions.c.id == staging)
            .values(expires_at=time.time() - 1)
        )
    with pytest.raises(LeaseExpiredError, match=staging):
        ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10, staged=staging)
    assert ix.list_snapshots() == []
    ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10)  # the take's session lives on


def test_settling_a_committed_staging_session_says_committed_and_changes_nothing(
    ix: Index,
) -> None:
    """What a rank that lost word of its take's commit asks (distributed/_outcome.py)."""
    take, staging, own, parts = _staged(ix)
    rec = ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10, staged=staging)
    assert ix.settle_session(staging) == "committed"
    assert ix.settle_session(staging) == "committed"
    assert ix.snapshot_chunk_ids(rec.id) == {*own, *parts}


def test_settling_a_staging_session_first_means_its_commit_never_happens(ix: Index) -> None:
    take, staging, own, parts = _staged(ix)
    assert ix.settle_session(staging) == "aborted"
    with pytest.raises(LeaseExpiredError, match="aborted"):
        ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10, staged=staging)
    assert ix.list_snapshots() == []
    assert ix.settle_session(staging) == "aborted"
    assert ix.settle_session("0" * 32) is None


def test_ending_a_session_that_ended_keeps_its_final_state(ix: Index) -> None:
    """Before, a take's exit ending its staging session as aborted overwrote the committed
    state its commit had written, and a rank settling after that was told "aborted"."""
    take, staging, own, parts = _staged(ix)
    rec = ix.commit_snapshot(take, snapshot("r", 1), ENTRIES, own, 10, staged=staging)
    ix.end_session(staging, "aborted")
    ix.end_session(take, "aborted")
    assert ix.settle_session(staging) == "committed"
    assert ix.snapshot_chunk_ids(rec.id) == {*own, *parts}
    with pytest.raises(NotFoundError):
        ix.end_session("0" * 32, "aborted")
