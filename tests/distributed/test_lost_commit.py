"""A distributed take whose commit and its word part: every rank's answer matches the store.

Rank 0 commits alone, then tells the others. Each way of losing that word (rank 0 dies right
after its commit, or right before it; rank 0 is slower than the others' timeout; another rank
dies while rank 0 commits) must leave every surviving rank saying what the store holds: a
rank told the take failed finds no snapshot of it, and one told it succeeded finds it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from tests.support.ranks import run_ranks

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
TIMEOUT = 5.0


def _take(rank: int, world: int, path: str, how: str, pids: str) -> dict[str, Any]:
    """Rank 0's commit is wrapped by ``how``; rank 1 records its pid in ``pids`` first."""
    from ckstore.distributed import _outcome
    from ckstore.engine.take.local import LocalTake
    from ckstore.errors import IndexError_
    from ckstore.index import Index

    Path(pids, f"rank{rank}").write_text(str(os.getpid()))
    store = ckstore.open(path, **TINY, create=True)
    if how == "lost-ack":  # rank 0's commit lands, its answer is lost; rank 1 asks later
        real_commit, real_settle = Index.commit_snapshot, Index.settle_session

        def commit_snapshot(self: Any, *a: Any, **k: Any) -> Any:
            real_commit(self, *a, **k)
            raise IndexError_("commit snapshot: connection to the index lost")

        def settle_later(self: Any, session_id: str) -> Any:
            time.sleep(3)
            return real_settle(self, session_id)

        if rank == 0:
            Index.commit_snapshot = commit_snapshot  # type: ignore[method-assign]
        else:
            Index.settle_session = settle_later  # type: ignore[method-assign]
    if how in ("unanswered", "flaky") and rank == 1:  # the index fails rank 1's settles
        _outcome.SETTLE_SECONDS = 2.0
        real_settle, failed = Index.settle_session, []

        def settle_session(self: Any, session_id: str) -> Any:
            if how == "unanswered" or len(failed) < 2:
                failed.append(session_id)
                raise IndexError_("settle session: database is locked")
            return real_settle(self, session_id)

        Index.settle_session = settle_session  # type: ignore[method-assign]
    if rank == 0:
        real = LocalTake.commit_root

        def commit_root(self: Any, *a: Any, **k: Any) -> Any:
            if how == "die-before":
                os.kill(os.getpid(), signal.SIGKILL)
            if how in ("slow", "unanswered", "flaky"):  # past the others' timeout, then commit
                time.sleep(TIMEOUT + 6)
            out = real(self, *a, **k)
            if how == "die-after":  # the node is lost right after the commit
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "other-dies":  # rank 1 is lost while rank 0 commits
                os.kill(int(Path(pids, "rank1").read_text()), signal.SIGKILL)
            return out

        LocalTake.commit_root = commit_root  # type: ignore[method-assign]
    state = ckstore.StateDict(w=torch.full((64,), float(rank)), step=1)
    try:
        snap = store.take({"m": state}, run="r", step=1, dist_timeout=TIMEOUT)
        return {"error": None, "id": snap.id}
    except ckstore.DistributedError as exc:
        chain, seen = [], exc  # what this rank's own part raised, under the group's error
        while seen is not None:
            chain.append(type(seen).__name__)
            seen = seen.__cause__ or seen.__context__
        return {"error": f"{type(exc).__name__}: {exc}", "chain": chain, "kind": chain[0]}
    finally:
        store.close()


def _outcome(tmp_path: Path, how: str) -> tuple[list[Any], list[str]]:
    path = str(tmp_path / "store")
    ckstore.open(path, **TINY, create=True).close()
    pids = tmp_path / "pids"
    pids.mkdir()
    res = run_ranks(_take, 2, tmp_path, path, how, str(pids), timeout=90)
    with ckstore.open(path) as store:
        ids = [s.id for s in store.log("r")] if "r" in store.runs() else []
        assert store.check(read_data=True).ok
    return res, ids


def test_rank_0_dying_right_after_its_commit_leaves_the_others_told_it_committed(
    tmp_path: Path,
) -> None:
    res, ids = _outcome(tmp_path, "die-after")
    assert res[0] is None  # killed
    told = res[1]["value"]
    assert len(ids) == 1 and told == {"error": None, "id": ids[0]}, (told, ids)


def test_rank_0_dying_before_its_commit_leaves_nothing_and_the_others_told_so(
    tmp_path: Path,
) -> None:
    res, ids = _outcome(tmp_path, "die-before")
    assert res[0] is None
    assert ids == [] and res[1]["value"]["error"], res[1]["value"]


def test_a_commit_slower_than_the_timeout_never_lands_after_the_others_gave_up(
    tmp_path: Path,
) -> None:
    """Rank 1 gives up at its timeout and settles the take's staging session: rank 0's commit,
    seconds later, finds it ended and commits nothing (before: committed, with rank 1 told
    the take had failed)."""
    res, ids = _outcome(tmp_path, "slow")
    told = [r["value"] for r in res]
    assert ids == [], (told, ids)
    assert all(t["error"] for t in told), told
    assert "LeaseExpiredError" in told[0]["chain"], told[0]  # the commit's lease check


@pytest.mark.parametrize("how", ["other-dies"])
def test_rank_0_that_committed_says_so_when_another_rank_is_lost_meanwhile(
    tmp_path: Path, how: str
) -> None:
    res, ids = _outcome(tmp_path, how)
    assert res[1] is None  # killed
    told = res[0]["value"]
    assert len(ids) == 1 and told == {"error": None, "id": ids[0]}, (told, ids)


def test_a_commit_whose_answer_was_lost_is_reported_committed_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 0's commit lands but the index's answer is lost. Before, rank 0 learnt from the
    index that it committed, then its take's exit ended the staging session as aborted over
    the committed state, and rank 1, asking a moment later, was told the take failed."""
    res, ids = _outcome(tmp_path, "lost-ack")
    told = [r["value"] for r in res]
    assert len(ids) == 1, (told, ids)
    assert told == [{"error": None, "id": ids[0]}] * 2, told


def test_a_rank_the_index_does_not_answer_says_the_outcome_is_unknown(tmp_path: Path) -> None:
    """Rank 1 gives up at its timeout and cannot settle (the index is locked): it cannot know,
    and must not say the take failed, for rank 0, slower, commits after (before: "commit
    failed", and the snapshot in the store)."""
    res, ids = _outcome(tmp_path, "unanswered")
    told = [r["value"] for r in res]
    assert told[1]["kind"] == "CommitUnknownError", told[1]
    assert "unknown" in told[1]["error"], told[1]
    assert ids == [told[0]["id"]], (told, ids)  # rank 0 committed


def test_a_settle_that_fails_for_a_moment_is_retried(tmp_path: Path) -> None:
    res, ids = _outcome(tmp_path, "flaky")
    told = [r["value"] for r in res]
    assert ids == [] and all(t["error"] for t in told), (told, ids)
    assert told[1]["kind"] == "RankLostError", told[1]  # told it failed, and it did
    assert "LeaseExpiredError" in told[0]["chain"], told[0]
