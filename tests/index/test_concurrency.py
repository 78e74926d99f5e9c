"""Several processes against one index: tag compare-and-swap and concurrent commits.

Workers are forked (no torch, nothing heavy imported); each opens its own Index.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any

from ckstore.errors import ConflictError
from ckstore.index import Index

from .helpers import commit

WORKERS = 4
ROUNDS = 6
COMMITS_PER_WORKER = 12

_ctx = mp.get_context("fork")


def _cas_worker(url: str, rank: int, targets: list[str], barrier: Any, out: Any) -> None:
    try:
        ix = Index.open(url, create=False)
        for round_no in range(ROUNDS):
            seen = ix.get_tag("hot")
            assert seen is not None
            barrier.wait(30)  # everyone has read the same version before anyone writes
            try:
                ix.set_tag("hot", targets[rank], expected_version=seen.version)
                out.put((round_no, rank, "won", seen.version))
            except ConflictError:
                out.put((round_no, rank, "lost", seen.version))
            barrier.wait(30)  # every write of this round is done before the next read
        ix.close()
    except BaseException:
        out.put((-1, rank, traceback.format_exc(), -1))
        barrier.abort()


def _commit_worker(url: str, rank: int, barrier: Any, out: Any) -> None:
    try:
        ix = Index.open(url, create=False)
        barrier.wait(30)
        for i in range(COMMITS_PER_WORKER):
            labels = [f"w{rank}-{i}", "shared", f"shared-{i}"]
            record = commit(ix, "busy", rank * 1000 + i, labels, tags=["+latest"])
            out.put(("ok", record.id))
        ix.close()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _run(target: Any, args_for: Any) -> list[Any]:
    out = _ctx.Queue()
    barrier = _ctx.Barrier(WORKERS)
    procs = [_ctx.Process(target=target, args=(*args_for(r), barrier, out)) for r in range(WORKERS)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (any(p.is_alive() for p in procs) or not out.empty()):
        try:  # drain while running: a child blocks on exit until its queue is read
            results.append(out.get(timeout=0.05))
        except queue.Empty:
            pass
    for p in procs:
        p.join(5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def test_tag_cas_one_winner_per_round(index_url: str) -> None:
    ix = Index.open(index_url)
    targets = [commit(ix, "cas", step).id for step in range(WORKERS)]
    ix.set_tag("hot", targets[0])
    ix.close()
    results = _run(_cas_worker, lambda r: (index_url, r, targets))
    errors = [r for r in results if r[0] == -1]
    assert not errors, errors[0][2]
    assert len(results) == WORKERS * ROUNDS
    for round_no in range(ROUNDS):
        rows = [r for r in results if r[0] == round_no]
        assert len({r[3] for r in rows}) == 1, rows  # all read the same version
        assert sum(r[2] == "won" for r in rows) == 1, rows
    with Index.open(index_url) as ix:
        tag = ix.get_tag("hot")
        assert tag is not None and tag.version == 1 + ROUNDS


def test_concurrent_commits(index_url: str) -> None:
    """No 'database is locked', no lost rows, one parent chain (SQLite and PostgreSQL)."""
    Index.open(index_url).close()
    results = _run(_commit_worker, lambda r: (index_url, r))
    errors = [r[1] for r in results if r[0] == "error"]
    assert not errors, errors[0]
    ids = {r[1] for r in results}
    assert len(ids) == WORKERS * COMMITS_PER_WORKER
    with Index.open(index_url) as ix:
        snaps = ix.list_snapshots("busy")
        assert {s.id for s in snaps} == ids
        # one linear chain in commit order: each snapshot's parent is the one before it
        chain = list(reversed(snaps))
        assert chain[0].parent_id is None
        assert all(b.parent_id == a.id for a, b in zip(chain, chain[1:], strict=False))
        for s in snaps:
            assert len(ix.snapshot_chunk_ids(s.id)) == 3
        tag = ix.get_tag("latest")
        assert tag is not None and tag.snapshot_id == snaps[0].id
        assert tag.version == WORKERS * COMMITS_PER_WORKER


def test_threads_share_one_index(index_url: str) -> None:
    """One Index used by several threads at once (the pool hands each its own connection)."""
    from concurrent.futures import ThreadPoolExecutor

    with Index.open(index_url) as ix:

        def work(t: int) -> list[str]:
            return [commit(ix, f"t{t % 2}", i, [f"x{t}-{i}", "common"]).id for i in range(5)]

        with ThreadPoolExecutor(4) as pool:
            ids = [sid for chunk in pool.map(work, range(4)) for sid in chunk]
        assert len(set(ids)) == 20
        assert sorted(s.id for s in ix.list_snapshots()) == sorted(ids)
        for run in ("t0", "t1"):
            chain = list(reversed(ix.list_snapshots(run)))
            assert all(b.parent_id == a.id for a, b in zip(chain, chain[1:], strict=False))


def test_threads_share_memory_index() -> None:
    test_threads_share_one_index("sqlite:///:memory:")
