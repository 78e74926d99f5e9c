"""Compaction after takes leaves loose what the job's retention is about to delete: the ages at
which this process deleted snapshots of a run (``engine/deletion_ages.py``) set how many of the
run's newest snapshots stay loose, so a keep-last-N job compresses nothing it then throws away,
while what it keeps longer (a tagged milestone) and a job that deletes nothing are compacted
as before."""

from __future__ import annotations

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.deletion_ages import MAX_KEEP_LOOSE, DeletionAges


@pytest.fixture
def store(store_path) -> ckstore.Store:
    """A store whose takes start a background compaction (the tests' default is off)."""
    s = ckstore.open(store_path, create=True, auto_compact=True)
    yield s
    s.close()


def _state(step: int) -> ckstore.StateDict:
    gen = torch.Generator().manual_seed(step)
    return ckstore.StateDict(w=torch.randn(1 << 16, generator=gen), step=step)


def _loose_of(store: ckstore.Store, ref: str) -> set[str]:
    loose = {
        c.chunk_id for c in store.repository.index.loose_chunks() if c.codec in objects.FAST_CODECS
    }
    return loose & set(store.get(ref).manifest.chunk_ids())


def test_ages_are_counted_in_this_process_commits_of_the_run_and_capped():
    ages = DeletionAges()
    for i in range(1, 4):
        ages.committed("a", f"a{i}")
        ages.committed("b", f"b{i}")
    assert ages.young() == set()  # nothing deleted: nothing learned
    ages.deleted(["a1", "b2", "elsewhere"])  # a1 had 2 commits of its run after it, b2 one
    assert ages.young() == {"a1", "a2", "a3", "b2", "b3"}  # a: its last 3 commits, b: last 2
    for i in range(4, 60):
        ages.committed("a", f"a{i}")
    ages.deleted(["a2"])  # a milestone dropped long after: at most MAX_KEEP_LOOSE stay loose
    assert {s for s in ages.young() if s.startswith("a")} == {
        f"a{i}" for i in range(60 - MAX_KEEP_LOOSE, 60)
    }


def test_a_keep_last_job_compresses_nothing_it_deletes_and_every_kept_snapshot_restores(store):
    reports = []
    want = {}
    for step in range(8):
        state = _state(step)
        store.take({"m": state}, run="r", step=step)
        want[step] = state["w"].clone()
        assert store.wait_compacted(60)
        reports.append(store.last_compaction)
        store.gc(keep_last=2, keep_healthy=False, grace_seconds=0)
    # the first deletion (after the third take) taught it the age: no compaction after it
    assert all(r is reports[2] for r in reports[3:])
    assert {s.step for s in store.log("r")} == {6, 7}
    for step in (6, 7):
        out = ckstore.StateDict(w=torch.zeros(1 << 16), step=-1)
        store.get(f"r@{step}").restore({"m": out})
        assert torch.equal(out["w"], want[step]) and out["step"] == step
    assert store.check().ok


def test_what_the_job_keeps_longer_is_compacted_and_a_job_that_deletes_nothing_compacts(store):
    for step in range(7):
        store.take({"m": _state(step)}, run="r", step=step)
        assert store.wait_compacted(60)
        if step == 1:
            store.tag("r@1", "milestone")
        store.gc(keep_last=2, keep_healthy=False, grace_seconds=0)  # keeps tagged snapshots
    assert {s.step for s in store.log("r")} == {1, 5, 6}
    assert not _loose_of(store, "r@1")  # older than the job deletes at: compacted
    assert _loose_of(store, "r@5")  # younger: left loose, as the job was about to drop it
    for step in range(3):
        store.take({"m": _state(100 + step)}, run="other", step=step)
        assert store.wait_compacted(60)
    assert not _loose_of(store, "other@0")  # no deletions in this run: compacted as before


def test_deletions_by_ref_teach_it_too(store):
    for step in range(6):
        store.take({"m": _state(step)}, run="r", step=step)
        assert store.wait_compacted(60)
        if step >= 2:
            deleted = store.get(f"r@{step - 2}").id
            store.delete(f"r@{step - 2}")  # a trainer's own rotation, one snapshot at a time
    young = store.repository.deletion_ages.young()
    assert young == {store.get(f"r@{step}").id for step in (4, 5)} | {deleted}
    assert _loose_of(store, "r@4") and _loose_of(store, "r@5")
