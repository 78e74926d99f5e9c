"""Review: compaction's new pin check counts the pins of a dead, expired session."""

from __future__ import annotations

import time
from pathlib import Path

import ckstore
from tests.support.remotes import KNOBS, fill, restores

OPTS = dict(KNOBS, auto_compact=False, delta_depth=2)


def _deltas_after_compaction(path: Path, pin_of_dead: list[str]) -> set[str]:
    with ckstore.open(path, create=True, **OPTS) as store:
        fill(store, "r", [1, 2, 3, 4, 5])
        index = store.repository.index
        if pin_of_dead:
            dead = index.begin_session("otherhost:4242:dead-take", 0.5)  # a take that crashed
            index.lookup_chunks(dead.id, pin_of_dead)
            time.sleep(1.0)  # its lease ran out long ago; no gc ran since
            assert all(s.id != dead.id for s in index.live_sessions())
        store.compact(keep_loose=1)
        assert all(restores(store, f"r@{i}", i) for i in (1, 2, 3, 4, 5))
        return {c.chunk_id for c in index.all_chunks() if c.base_id is not None}


def test_a_chunk_pinned_only_by_an_expired_session_is_still_compacted(tmp_path: Path) -> None:
    baseline = _deltas_after_compaction(tmp_path / "a", [])
    assert baseline, "compaction made no delta: the scenario needs one"
    some = sorted(baseline)[:3]
    after = _deltas_after_compaction(tmp_path / "b", some)
    assert set(some) <= after, (
        f"{len(set(some) - after)} of {len(some)} chunks stayed loose: pinned by a session "
        "whose lease ran out (a crashed take), counted as a live writer's"
    )
