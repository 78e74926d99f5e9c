"""SIGKILL a take, a gc or a compaction at every enumerated point; the store must stay whole
(I1, I2, I4).

Each case forks a child from this process (torch already imported: no start-up cost), which
opens the store afresh, arms one kill point and runs a take or a gc; the armed call kills the
child with SIGKILL just before or just after it runs (no ``finally``, no atexit: what a power
cut or the OOM killer leaves). The parent then checks that:

- every visible snapshot restores bit-exactly (its content is a function of its step);
- the snapshot being taken is visible iff the kill came after its commit;
- ``check(read_data=True)`` is clean (orphans of the dead take are garbage, not damage);
- once the dead take's lease has run out, ``gc(grace_seconds=0)`` removes every orphan and
  leaves a store that checks clean and still restores every snapshot.

A point that is never reached fails the test (the child exits normally), so the list below is
the truth about where a take and a gc can die. ``CKSTORE_SOAK=1`` also runs random kill points
with random call counts (``test_random_kill_points``; bounded to a few otherwise).
"""

from __future__ import annotations

import fnmatch
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.objects.wrappers import WrappingBackend
from tests.support.gc_workers import state_for

KNOBS = {"chunk_bytes": 1024, "pack_bytes": 4096, "inline_bytes": 64}
BASE_STEPS = 5
NEW_STEP = BASE_STEPS + 1

# (what to wrap, name glob for backend calls, which matching call, before or after it)
TAKE_POINTS = [
    ("writer.write", None, 3, "after"),  # a pack half streamed into its staging file
    ("backend.put", "packs/*", 1, "before"),
    ("os.link", None, 1, "before"),  # a pack's temp file written and fsynced, never linked
    ("backend.put", "packs/*", 1, "after"),  # a pack durable, not yet in the index
    (
        "backend.put",
        "packs/*",
        2,
        "after",
    ),  # (a take records its packs in the commit's transaction)
    ("index.lookup_chunks", None, 1, "after"),  # chunks pinned, nothing written
    ("backend.put", "manifests/*", 1, "before"),
    ("backend.put", "manifests/*", 1, "after"),  # manifest durable, not committed
    ("index.commit_snapshot", None, 1, "before"),
    ("index.commit_snapshot", None, 1, "after"),  # committed: the snapshot must be visible
]
GC_POINTS = [
    ("index.delete_snapshot", None, 1, "after"),  # forgot one of the snapshots it drops
    ("index.expire_sessions", None, 1, "after"),
    ("index.prune_chunks", None, 1, "after"),  # chunk rows gone, their packs still stored
    ("backend.put", "packs/*", 1, "after"),  # repack: new pack durable, index not switched
    ("index.relocate_chunks", None, 1, "after"),  # switched, the old pack not yet retired
    ("index.retire_packs", None, 2, "after"),
    ("index.delete_retired_packs", None, 1, "after"),  # rows gone, objects not
    ("backend.delete", "packs/*", 1, "after"),
    ("backend.delete", "manifests/*", 1, "after"),
    ("backend.delete", "packs/*", 3, "before"),  # orphans of an earlier crashed take
]
COMPACT_POINTS = [
    ("index.lookup_chunks", None, 1, "after"),  # delta bases pinned, nothing written
    ("backend.put", "packs/*", 1, "before"),
    ("os.link", None, 1, "before"),  # a dense pack's temp file written and fsynced, never linked
    ("backend.put", "packs/*", 1, "after"),  # a dense pack durable, the index not switched
    ("index.rewrite_chunks", None, 1, "before"),
    ("index.rewrite_chunks", None, 1, "after"),  # switched, the loose packs not yet retired
    ("index.retire_packs", None, 1, "after"),
    (
        "index.delete_retired_packs",
        None,
        1,
        "after",
    ),  # the emptied loose packs' rows gone, objects not
    ("backend.delete", "packs/*", 1, "after"),  # one emptied loose pack deleted, the others not
    ("backend.put", "packs/*", 2, "after"),  # the second dense pack durable, not switched
]


class _KillAt(WrappingBackend):
    """Forwards to ``inner``; SIGKILLs the process at the armed call."""

    def __init__(self, inner: Any, arm: Any) -> None:
        super().__init__(inner)
        self.arm = arm

    def put(self, name, data):
        return self.arm("backend.put", name, lambda: self.inner.put(name, data))

    def delete(self, name):
        return self.arm("backend.delete", name, lambda: self.inner.delete(name))

    def writer(self, direct=False):
        """The local backend's streaming writer (packs go to a staging file as they fill):
        its writes are the point ``writer.write``, its commit is the pack's ``backend.put``."""
        return _KillWriter(self.inner.writer(direct), self.arm)


class _KillWriter:
    def __init__(self, inner: Any, arm: Any) -> None:
        self.inner, self.arm = inner, arm
        self.holds_data = inner.holds_data

    def write(self, data):
        return self.arm("writer.write", None, lambda: self.inner.write(data))

    def patch(self, offset, data):
        return self.inner.patch(offset, data)

    def commit(self, name):
        return self.arm("backend.put", name, lambda: self.inner.commit(name))

    def abort(self):
        return self.inner.abort()


def _armed(point: tuple[str, str | None, int, str]):
    target, pattern, nth, when = point
    seen = [0]

    def arm(what: str, name: str | None, call):
        if what == target and (pattern is None or fnmatch.fnmatchcase(name or "", pattern)):
            seen[0] += 1
            if seen[0] == nth:
                if when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                result = call()
                os.kill(os.getpid(), signal.SIGKILL)
                return result
        return call()

    return arm


def _child(path: str, job: str, point) -> None:
    store = ckstore.open(path, create=False)
    arm = _armed(point)
    store.repository.objects._backend = _KillAt(store.repository.objects.backend, arm)
    for name in (
        "add_pack",
        "commit_snapshot",
        "lookup_chunks",
        "delete_snapshot",
        "expire_sessions",
        "prune_chunks",
        "relocate_chunks",
        "retire_packs",
        "delete_retired_packs",
        "rewrite_chunks",
    ):
        real = getattr(store.repository.index, name)
        setattr(
            store.repository.index,
            name,
            lambda *a, _n=name, _r=real, **k: arm(f"index.{_n}", None, lambda: _r(*a, **k)),
        )
    real_link = os.link
    os.link = lambda *a, **k: arm("os.link", None, lambda: real_link(*a, **k))  # type: ignore[assignment]
    if job == "take":
        store.take({"s": ckstore.StateDict(state_for(NEW_STEP))}, run="loop", step=NEW_STEP)
    elif job == "compact":
        store.compact()
    else:
        store.gc(keep_last=2, grace_seconds=0, repack_below=0.9)
    os._exit(0)  # the point was never reached


def _run_killed(path: Path, job: str, point) -> int | None:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(str(path), job, point))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"{job} child hung at {point}")
    return proc.exitcode


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Six committed snapshots; with_orphan: plus the packs of a take killed before indexing."""
    path = tmp_path_factory.mktemp("crash") / "store"
    s = ckstore.open(path, **KNOBS, create=True)
    for step in range(1, BASE_STEPS + 1):
        s.take({"s": ckstore.StateDict(state_for(step))}, run="loop", step=step)
    s.close()
    return path


def _copy(template: Path, tmp_path: Path) -> Path:
    path = tmp_path / "store"
    shutil.copytree(template, path)
    return path


def _assert_whole(path: Path, expect_new: bool | None) -> list[int]:
    store = ckstore.open(path, create=False)
    try:
        steps = sorted(s.step for s in store.log())
        if expect_new is not None:
            assert (NEW_STEP in steps) == expect_new, steps
        _restores_all(store)
        report = store.check(read_data=True)
        assert report.ok, report.problems
        store.repository.index.expire_sessions(
            time.time() + 10 * store.lease_seconds
        )  # the dead take's lease
        store.gc(grace_seconds=0)
        after = store.check(read_data=True)
        assert after.ok and after.orphan_packs == [] and after.orphan_manifests == [], after
        assert not [p for p in path.rglob(".*") if p.is_file()], "gc left a staging file behind"
        assert sorted(s.step for s in store.log()) == steps
        _restores_all(store)
        return steps
    finally:
        store.close()


def _restores_all(store) -> None:
    for snap in store.log():
        want = state_for(snap.step)
        out = {"s": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
        snap.restore(out)
        assert all(torch.equal(out["s"][k], v) for k, v in want.items()), snap.ref


@pytest.mark.parametrize("point", TAKE_POINTS, ids=lambda p: f"{p[0]}:{p[1] or ''}:{p[2]}:{p[3]}")
def test_take_killed_at_every_point_leaves_the_store_whole(template, tmp_path, point):
    path = _copy(template, tmp_path)
    assert _run_killed(path, "take", point) == -signal.SIGKILL, "the kill point was never reached"
    committed = point[0] == "index.commit_snapshot" and point[3] == "after"
    assert _assert_whole(path, expect_new=committed) == list(range(1, BASE_STEPS + 1)) + (
        [NEW_STEP] if committed else []
    )


@pytest.fixture(scope="module")
def gc_template(template, tmp_path_factory):
    """The six snapshots plus the orphan packs and pins of a take killed mid-write."""
    path = tmp_path_factory.mktemp("crash-gc") / "store"
    shutil.copytree(template, path)
    # the second pack is durable but was never indexed: an orphan
    assert _run_killed(path, "take", ("backend.put", "packs/*", 2, "after")) == -signal.SIGKILL
    s = ckstore.open(path, create=False)
    s.repository.index.expire_sessions(time.time() + 10 * s.lease_seconds)  # its lease ran out
    assert s.check().orphan_packs
    s.close()
    return path


@pytest.mark.parametrize("point", GC_POINTS, ids=lambda p: f"{p[0]}:{p[1] or ''}:{p[2]}:{p[3]}")
def test_gc_killed_at_every_point_leaves_the_store_whole(gc_template, tmp_path, point):
    path = _copy(gc_template, tmp_path)
    assert _run_killed(path, "gc", point) == -signal.SIGKILL, "the kill point was never reached"
    steps = _assert_whole(path, expect_new=False)
    assert {BASE_STEPS - 1, BASE_STEPS} <= set(steps)  # keep_last=2 never drops these


@pytest.mark.parametrize(
    "point", COMPACT_POINTS, ids=lambda p: f"{p[0]}:{p[1] or ''}:{p[2]}:{p[3]}"
)
def test_compaction_killed_at_every_point_leaves_the_store_whole(template, tmp_path, point):
    """Loose packs of five takes (deltas against parents), compaction killed anywhere: every
    snapshot restores, check is clean, and the next compaction finishes the job."""
    path = _copy(template, tmp_path)
    assert _run_killed(path, "compact", point) == -signal.SIGKILL, (
        "the kill point was never reached"
    )
    assert _assert_whole(path, expect_new=False) == list(range(1, BASE_STEPS + 1))
    with ckstore.open(path, create=False) as store:
        store.repository.index.expire_sessions(time.time() + 10 * store.lease_seconds)
        store.compact()
        newest = store.repository.index.snapshot_chunk_ids(store.get("loop").id)
        loose = {
            c.chunk_id
            for c in store.repository.index.loose_chunks()
            if c.codec in ("none", "exp-zstd")
        }
        assert loose <= newest, "chunks of older snapshots stayed loose"
        assert store.check(read_data=True).ok
        _restores_all(store)


@pytest.mark.soak
def test_random_kill_points(template, gc_template, tmp_path):
    """The soak: random points with random call counts (CKSTORE_SOAK=1: 40 runs; else 2)."""
    rng = random.Random(os.environ.get("CKSTORE_SOAK_SEED", "7"))
    runs = 40 if os.environ.get("CKSTORE_SOAK") else 2
    for i in range(runs):
        job = rng.choice(["take", "gc"])
        target, pattern, _, _ = rng.choice(TAKE_POINTS if job == "take" else GC_POINTS)
        point = (target, pattern, rng.randint(1, 4), rng.choice(["before", "after"]))
        path = _copy(template if job == "take" else gc_template, tmp_path / str(i))
        code = _run_killed(path, job, point)
        assert code in (0, -signal.SIGKILL), (point, code)
        _assert_whole(path, expect_new=None)
