"""Retention and garbage collection, alone and beside live writers in other processes."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.locations import read_following, to_location
from ckstore.engine.restore.reader import Reader
from ckstore.errors import ObjectNotFoundError
from ckstore.history.policy import Policy
from ckstore.index import ChunkRecord, SnapshotRecord
from tests.support.gc_beside import sweep_at_first_switch
from tests.support.gc_workers import drifting_state_for, state_for
from tests.support.paths import REPO

ROOT = str(REPO)


def _rec(run: str, step: int, age: float, now: float = 1e6) -> SnapshotRecord:
    return SnapshotRecord(
        f"{run}{step:04d}".ljust(64, "0"), run, step, None, "m", now - age, {}, 0, 0, 0, 0
    )


def test_keep_last_keeps_the_highest_steps_when_a_run_commits_out_of_order():
    """Two hosts share a run and one raced ahead: its step 6 committed before the other's 1,
    3 and 5. Keeping the last 3 keeps steps 4, 5 and 6, not the last three commits (which would
    drop the run's newest training state); a run without steps keeps its last commits."""
    now = 1e6
    commits = [6, 1, 2, 3, 4, 5]  # commit order, oldest first
    snaps = [_rec("shared", step, age=100 - i, now=now) for i, step in enumerate(commits)][::-1]
    dropped = Policy(keep_last=3).select(snaps, set(), now)
    assert sorted(s.step for s in dropped) == [1, 2, 3]
    no_steps = [
        SnapshotRecord(f"n{i}".ljust(64, "0"), "n", None, None, "m", now - 100 + i, {}, 0, 0, 0, 0)
        for i in range(4)
    ][::-1]
    assert [s.id[:2] for s in Policy(keep_last=3).select(no_steps, set(), now)] == ["n0"]


def test_keep_last_keeps_a_rewound_runs_last_commit_too(tmp_path):
    """Steps 100, 200, 300; the run rolled back to 200 and trained on at 210 and 220. Before,
    ``keep_last=1`` kept step 300 (the abandoned branch) and dropped 220, the state
    ``get(run)`` resumes from, so the next resume restored the abandoned state."""
    with ckstore.open(tmp_path / "s", chunk_bytes=1024, pack_bytes=4096, create=True) as store:
        for step in (100, 200, 300, 210, 220):
            store.take({"s": ckstore.StateDict(state_for(step))}, run="sft", step=step)
        latest = store.get("sft")
        assert latest.step == 220
        report = store.gc(keep_last=1, keep_healthy=False, grace_seconds=0)
        assert sorted(report.snapshots_dropped) == ["sft@100", "sft@200", "sft@210"]
        assert store.get("sft").id == latest.id and [s.step for s in store.log()] == [220, 300]
        got = store.get("sft").read_object("s")
        assert all(torch.equal(got[k], v) for k, v in state_for(220).items())
        assert store.check(read_data=True).ok


def test_keep_last_keeps_the_runs_last_commit_whatever_the_takes_clocks(tmp_path, monkeypatch):
    """A run rewound and resumed on a host whose clock is a minute behind: its last commit is
    not the newest by the takes' clocks (gc's listing across runs), yet ``get(run)`` resumes
    from it. Before, gc found "the last commit" by that listing and dropped it."""
    import ckstore.engine.take.local as local

    with ckstore.open(tmp_path / "s", chunk_bytes=1024, pack_bytes=4096, create=True) as store:
        for step in (100, 200):
            store.take({"s": ckstore.StateDict(state_for(step))}, run="r", step=step)
        real = time.time
        monkeypatch.setattr(local.time, "time", lambda: real() - 60.0)
        rewound = store.take({"s": ckstore.StateDict(state_for(110))}, run="r", step=110)
        monkeypatch.undo()
        assert store.get("r").id == rewound.id and store.get("r@healthy").id == rewound.id
        store.gc(keep_last=1, grace_seconds=0)
        assert store.get("r").id == rewound.id, [s.ref for s in store.log()]
        assert store.get("r@healthy").id == rewound.id


def test_policy_rules():
    now = 1e6
    snaps = [_rec("a", s, age=100 - s, now=now) for s in range(10, 0, -1)] + [
        _rec("b", 1, 500, now)
    ]
    tagged = {snaps[-2].id}  # a@1

    def dropped(**kw):
        return sorted(f"{s.run}@{s.step}" for s in Policy(**kw).select(snaps, tagged, now))

    assert dropped() == []  # no rule: prune only
    assert dropped(keep_last=3) == sorted(
        f"a@{s}" for s in range(2, 8)
    )  # b keeps its only one, a@1 tagged
    assert dropped(keep_last=3, keep_tagged=False) == sorted([f"a@{s}" for s in range(1, 8)])
    assert dropped(keep_last=0, keep_every_steps=5, runs=("a",)) == sorted(
        f"a@{s}" for s in (2, 3, 4, 6, 7, 8, 9)
    )
    assert dropped(keep_last=1, older_than=95) == sorted(f"a@{s}" for s in (2, 3, 4, 5))
    with pytest.raises(ckstore.InvalidInputError):
        Policy(keep_last=-1)


def _fill(store, n=6):
    st = ckstore.StateDict(w=torch.zeros(64, 64), b=torch.full((32, 32), -7.0))
    for step in range(1, n + 1):
        st["w"][:8] = float(step)  # every step rewrites the same rows: one new chunk each
        store.take({"s": st}, run="r", step=step)
    return st


def _metric(run: str, step: int, meta: dict, now: float = 1e6) -> SnapshotRecord:
    return SnapshotRecord(
        f"{run}{step:04d}".ljust(64, "0"), run, step, None, "m", now - 100 + step, meta, 0, 0, 0, 0
    )


def test_keep_best_keeps_the_top_k_of_each_run_by_a_metadata_value():
    """``save_top_k`` / ``load_best_model_at_end``: the k lowest losses (or highest
    accuracies) of each run stay; snapshots without the value are not ranked."""
    losses = {1: 2.0, 2: 0.5, 3: 0.9, 4: 0.7, 5: float("nan"), 6: None, 7: 0.5}
    snaps = [
        _metric("a", s, {} if v is None else {"loss": v, "eval": {"acc": -v}})
        for s, v in losses.items()
    ][::-1] + [_metric("b", 1, {"loss": 9.0, "eval": {"acc": -9.0}})]

    def kept(**kw):
        dropped = {s.id for s in Policy(**kw).select(snaps, set(), 1e6)}
        return sorted(f"{s.run}@{s.step}" for s in snaps if s.id not in dropped)

    # ties (2 and 7 at 0.5) go to the newer; NaN, absent and non-numbers are not ranked
    assert kept(keep_best=2, metric="loss", keep_healthy=False) == ["a@2", "a@7", "b@1"]
    assert kept(keep_best=1, metric="loss", keep_healthy=False) == ["a@7", "b@1"]
    assert kept(keep_best=1, metric="eval.acc", mode="max", keep_healthy=False) == ["a@7", "b@1"]
    assert kept(keep_best=1, metric="loss", keep_last=2, keep_healthy=False) == [
        "a@6", "a@7", "b@1"
    ]  # fmt: skip
    assert kept(keep_best=0, metric="loss", keep_healthy=False) == []
    with pytest.raises(ckstore.InvalidInputError, match="metric='loss'"):
        Policy(keep_best=2)
    with pytest.raises(ckstore.InvalidInputError, match="keep_best=N"):
        Policy(metric="loss")
    with pytest.raises(ckstore.InvalidInputError, match="'min'"):
        Policy(keep_best=1, metric="loss", mode="lowest")


def test_gc_keep_best_through_the_store_and_the_command_line(store, capsys):
    for step, loss in enumerate((3.0, 1.0, 2.0, 0.5, 4.0)):
        store.take(
            {"s": ckstore.StateDict(w=torch.full((64,), float(step)))},
            run="r",
            step=step,
            metadata={"loss": loss},
        )
    report = store.gc(keep_best=2, metric="loss", grace_seconds=0, keep_healthy=False)
    assert sorted(report.snapshots_dropped) == ["r@0", "r@2", "r@4"]
    assert [s.step for s in store.log()] == [3, 1]
    from ckstore import cli

    code = cli.main(["--store", store.url, "gc", "--keep-best", "1", "--metric", "loss",
                     "--mode", "max", "--no-keep-healthy", "--grace", "0s", "--dry-run"])  # fmt: skip
    assert code == 0 and "r@3" in capsys.readouterr().out  # the highest loss (1.0) stays
    assert cli.main(["--store", store.url, "gc", "--keep-best", "1"]) == 2  # no --metric
    assert "metric='loss'" in capsys.readouterr().err


def test_gc_keeps_last_and_tagged_and_reclaims_the_rest(store):
    _fill(store)
    store.tag("r@2", "best")
    before = sum(
        store.repository.objects.pack_size(p) for p in store.repository.objects.list_packs()
    )
    dry = store.gc(keep_last=2, dry_run=True, grace_seconds=0)
    assert dry.dry_run and sorted(dry.snapshots_dropped) == ["r@1", "r@3", "r@4"]
    assert len(store.log()) == 6  # a dry run changes nothing
    report = store.gc(keep_last=2, grace_seconds=0)
    assert sorted(report.snapshots_dropped) == sorted(dry.snapshots_dropped)
    assert report.chunks_removed == dry.chunks_removed > 0 and report.bytes_reclaimed > 0
    assert [s.step for s in store.log()] == [6, 5, 2]
    after = sum(
        store.repository.objects.pack_size(p) for p in store.repository.objects.list_packs()
    )
    assert after < before
    for snap in store.log():
        assert float(snap.read_object("s/w")[0, 0]) == snap.step
    again = store.gc(keep_last=2, grace_seconds=0)
    assert again.snapshots_dropped == [] and again.chunks_removed == 0 and again.packs_removed == 0
    assert store.check(read_data=True).ok


def test_grace_period_protects_recent_data(store):
    """What another handle (another process) deleted waits for the grace period."""
    _fill(store, 3)
    other = ckstore.open(store.url)
    other.delete("r@1")
    report = store.gc()  # default grace: hours
    assert report.chunks_removed == 0 and report.packs_removed == 0 and report.purged_now == 0
    assert report.grace_kept_bytes > 0
    assert store.gc(grace_seconds=0).chunks_removed > 0
    other.close()


def test_a_purge_by_the_deleting_handle_frees_the_disk_at_once(store):
    """A training job that deletes its own old snapshots gets the disk back within the job when
    nothing else writes; while any write session is alive its data waits for the grace period
    like everyone's, and the next gc after that session ends reclaims it."""
    _fill(store, 4)
    index = store.repository.index
    session = index.begin_session("another-host:1", 600.0)  # someone else is writing
    store.delete("r@1")
    store.delete("r@2")
    held = store.gc()
    assert held.purged_now == 0 and held.chunks_removed == 0 and held.grace_kept_bytes > 0
    index.end_session(session.id, "committed")
    packs = set(store.repository.objects.list_packs())
    report = store.gc()
    assert report.purged_now == report.chunks_removed > 0 and report.bytes_reclaimed > 0
    assert report.grace_kept_bytes == 0 and len(store.repository.objects.list_packs()) < len(packs)
    for snap in store.log():
        assert float(snap.read_object("s/w")[0, 0]) == snap.step
    assert store.check(read_data=True).ok
    assert store.gc().purged_now == 0  # done once
    dry = store.gc(dry_run=True)
    assert dry.purged_now == 0


def test_sparse_packs_are_rewritten_and_still_read(store_path):
    store = ckstore.open(store_path, chunk_bytes=1024, pack_bytes=64 * 1024, create=True)
    keep = torch.randn(64, 16)  # four chunks that stay alive (not inline: > 2 KiB)
    store.take({"s": ckstore.StateDict(keep=keep, big=torch.randn(128, 64))}, run="a")
    store.take({"s": ckstore.StateDict(keep=keep)}, run="b")
    store.delete("a")
    report = store.gc(grace_seconds=0, repack_below=0.5)
    assert report.packs_rewritten == 1 and report.packs_removed >= 1
    assert torch.equal(store.get("b").read_object("s/keep"), keep)
    assert store.check(read_data=True).ok and len(store.repository.objects.list_packs()) == 1


def test_orphans_of_a_crashed_take_are_removed_only_when_no_writer_can_own_them(store, monkeypatch):
    _fill(store, 1)

    def crash(
        *args, **kwargs
    ):  # the take dies after its packs are durable, before its commit indexes them
        raise ckstore.errors.IndexError_("simulated crash")

    with monkeypatch.context() as m:
        m.setattr(store.repository.index, "commit_snapshot", crash)
        with pytest.raises(ckstore.CkstoreError):
            # 15 chunks of 1 KiB: the last pack is never full, stored raw or compressed
            store.take({"s": ckstore.StateDict(x=torch.randn(60, 64))}, run="crash")
    assert store.check().orphan_packs and store.check().ok  # garbage, not damage
    live = store.repository.index.begin_session(
        "someone-else", 60
    )  # a writer that began before GC listed
    assert store.gc(grace_seconds=0).orphans_removed == 0
    store.repository.index.end_session(live.id, "aborted")
    assert store.gc(grace_seconds=0).orphans_removed > 0
    assert store.check().orphan_packs == [] and store.check(read_data=True).ok


def _run(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.gc_workers", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("deltas", [False, True], ids=["whole", "deltas"])
def test_gc_beside_a_live_writer_never_breaks_a_committed_snapshot(
    tmp_path, dialect, deltas, request
):
    """With ``deltas`` every take chains onto the one before while gc forgets all but the last
    two and repacks: no chain may ever lose a link."""
    url = str(tmp_path / "store")
    index = "" if dialect == "sqlite" else request.getfixturevalue("pg").new_database()
    ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True).close()
    seconds = "6" if deltas else "8"
    writer = _run("take-deltas" if deltas else "take", url, index, seconds)
    collector = _run("gc", url, index, seconds)
    w_out, w_err = writer.communicate(timeout=120)
    g_out, g_err = collector.communicate(timeout=120)
    assert writer.returncode == 0, w_err
    assert collector.returncode == 0, g_err
    store = ckstore.open(url, index=index or None, create=True)
    report = store.check(read_data=True)
    assert report.ok, report.problems
    snaps = store.log()
    assert snaps, w_out
    for snap in snaps:  # every committed snapshot restores bit-exactly
        got = snap.read_object("s")
        want = (drifting_state_for if deltas else state_for)(snap.step)
        assert all(torch.equal(got[k], want[k]) for k in want), snap.step
    if deltas:
        assert any(c.base_id for c in store.repository.index.all_chunks()), (
            "the takes stored no delta"
        )
    took = int(w_out.split()[1])
    failures = int(w_out.split()[3])
    assert took > 5 and failures == 0, (w_out, w_err)  # GC never makes a take fail
    gc_runs = int(g_out.split()[2])
    assert gc_runs > 5, g_out


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def test_takes_with_deltas_beside_a_compaction_and_a_gc_all_stay_readable(
    tmp_path, dialect, request
):
    """Four processes on one store: two runs' takes storing deltas against their parent, a compaction
    re-encoding older snapshots, and a gc forgetting all but the last two. On PostgreSQL their
    transactions run side by side (a commit share-locking its bases, a switch locking its rows,
    a gc's barrier): none may deadlock, fail a take, or leave a chain unreadable."""
    url = str(tmp_path / "store")
    index = "" if dialect == "sqlite" else request.getfixturevalue("pg").new_database()
    ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True).close()
    procs = {
        "w1": _run("take-deltas", url, index, "6", "one"),
        "w2": _run("take-deltas", url, index, "6", "two"),
        "c": _run("compact", url, index, "6"),
        "g": _run("gc", url, index, "6"),
    }
    outs = {n: p.communicate(timeout=180) for n, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, outs[name][1]
    for w in ("w1", "w2"):
        w_out, w_err = outs[w]
        assert int(w_out.split()[1]) > 5 and int(w_out.split()[3]) == 0, (w_out, w_err)
    assert int(outs["c"][0].split()[2]) > 2, outs["c"]
    store = ckstore.open(url, index=index or None)
    report = store.check(read_data=True)
    assert report.ok, report.problems
    for snap in store.log():
        got = snap.read_object("s")
        want = drifting_state_for(snap.step)
        assert all(torch.equal(got[k], want[k]) for k in want), snap.step
    deepest = max(c.depth for c in store.repository.index.all_chunks())
    assert deepest <= 4, deepest  # delta_depth 3, one more only where a commit recomputed it
    store.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_take_paused_past_its_lease_fails_and_commits_nothing(tmp_path):
    url = str(tmp_path / "store")
    store = ckstore.open(url, chunk_bytes=1024, pack_bytes=4096, create=True)
    store.take({"s": ckstore.StateDict(state_for(1))}, run="old", step=1)
    store.delete("old")  # its chunks are now unreferenced: the paused take will dedup against them
    env = dict(os.environ, CKSTORE_LEASE_SECONDS="1.0")
    child = _run("pause", url, "", env=env)
    deadline = time.time() + 60
    while not _stopped(child.pid):
        assert time.time() < deadline and child.poll() is None, child.communicate()
        time.sleep(0.05)
    time.sleep(1.5)  # the lease runs out while the take is stopped
    report = store.gc(grace_seconds=0)
    assert report.sessions_expired == 1 and report.chunks_removed > 0  # its pins were dropped
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3, (out, err)
    assert "LeaseExpiredError" in out
    assert store.log() == [] and store.check(read_data=True).ok
    store.gc(grace_seconds=0)
    assert store.check().orphan_packs == [] and store.check().orphan_manifests == []


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("digests", [True, False], ids=["digests", "no-digests"])
def test_a_restore_follows_chunks_that_gc_moved_while_it_ran(
    tmp_path: Path, atomic: bool, digests: bool
) -> None:
    """A reader that located its chunks before gc repacked them and deleted the old pack (its
    grace period over) looks them up again and reads them at their new place, instead of
    failing with ObjectNotFoundError (docs/RELIABILITY.md, I4)."""
    from ckstore.engine.restore.phases import apply, prepare
    from tests.support.states import forget_payload_digests

    g = torch.Generator().manual_seed(7)
    keep, drop = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    with ckstore.open(tmp_path / "s", chunk_bytes=4096, create=True) as store:
        store.take({"m": ckstore.StateDict(keep=keep, drop=drop)}, run="mix")  # one pack
        store.take({"m": ckstore.StateDict(keep=keep)}, run="solo")
        if not digests:
            forget_payload_digests(store)
        old_packs = set(store.repository.objects.list_packs())
        dest = {"m": ckstore.StateDict(keep=torch.zeros(64, 64))}
        reader = Reader.of(store.get("solo").view)
        prepared = prepare(
            reader, dest, budget=0, atomic=atomic
        )  # located (and, atomic, checked) now
        if not atomic:  # its one pass locates as it starts: locate now, as a slow reader would have
            assert prepared.fetcher is not None
            prepared.fetcher._locate(prepared.jobs)  # noqa: SLF001
        store.delete("mix")
        assert store.gc(grace_seconds=0, repack_below=1.0).packs_rewritten == 1
        store.gc(grace_seconds=0, repack_below=1.0)  # deletes the retired pack
        assert not old_packs & set(store.repository.objects.list_packs())
        apply(prepared, reader)
        assert torch.equal(dest["m"]["keep"], keep)
        got = store.get("solo").read_object("m/keep")
        assert torch.equal(got, keep)


class _MovedAgain:
    """An index whose next answer, once armed, places each chunk asked for in a pack that is
    gone already: the chunk moved again between the lookup and the read (gc and compaction
    beside a slow reader, every grace period over)."""

    def __init__(self, index: Any) -> None:
        self.index, self.armed, self.lied = index, False, 0

    def chunk_locations(self, ids: Any) -> dict[str, ChunkRecord]:
        found = dict(self.index.chunk_locations(ids))
        if self.armed:
            self.armed = False
            self.lied += 1
            for cid in list(found):
                found[cid] = dataclasses.replace(found[cid], pack_id="f" * 64)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)


def test_a_restore_follows_a_chunk_that_moved_again_while_it_was_looked_up(
    tmp_path: Path,
) -> None:
    """The first look-up after the chunk's pack went points at a pack gone too: the restore
    looks it up again (up to ``MAX_MOVES`` times) instead of failing with ObjectNotFoundError;
    before, it followed one move only. (An atomic restore of a local store reads the mapped
    views its first pass kept: no look-up there.)"""
    from ckstore.engine.restore.phases import apply, prepare

    g = torch.Generator().manual_seed(8)
    keep, drop = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    with ckstore.open(tmp_path / "s", chunk_bytes=4096, create=True) as store:
        store.take({"m": ckstore.StateDict(keep=keep, drop=drop)}, run="mix")
        store.take({"m": ckstore.StateDict(keep=keep)}, run="solo")
        reader = Reader.of(store.get("solo").view)
        moving = _MovedAgain(reader.index)
        reader.index = moving
        dest = {"m": ckstore.StateDict(keep=torch.zeros(64, 64))}
        prepared = prepare(reader, dest, budget=0, atomic=False)
        assert prepared.fetcher is not None
        prepared.fetcher._locate(prepared.jobs)  # noqa: SLF001 - located now, as a slow reader
        store.delete("mix")
        store.gc(grace_seconds=0, repack_below=1.0)
        store.gc(grace_seconds=0, repack_below=1.0)  # the old pack is gone
        moving.armed = True
        apply(prepared, reader)
        assert moving.lied == 1
        assert torch.equal(dest["m"]["keep"], keep)


def test_reading_follows_a_chunk_through_every_move_and_stops_where_it_did_not_move() -> None:
    cid = "ab" * 32

    def rec(pack: str) -> ChunkRecord:
        return ChunkRecord(cid, pack * 64, 0, 8, 8, "none", None, 0, None)

    def read(loc: Any) -> str:
        tried.append(loc.pack_id[0])
        if loc.pack_id[0] != "c":
            raise ObjectNotFoundError(f"pack {loc.pack_id} is gone")
        return "read"

    tried: list[str] = []
    answers = iter([{cid: rec("b")}, {cid: rec("c")}])
    assert read_following(lambda ids: next(answers), to_location(rec("a")), read) == "read"
    assert tried == ["a", "b", "c"]
    tried.clear()
    with pytest.raises(ObjectNotFoundError):  # looked up again in the same place: gone for good
        read_following(lambda ids: {cid: rec("a")}, to_location(rec("a")), read)
    assert tried == ["a"]
    with pytest.raises(ObjectNotFoundError):  # no longer in the index
        read_following(lambda ids: {}, to_location(rec("a")), read)


def test_gc_sweeps_staging_files_of_killed_writers(tmp_path) -> None:
    """A take killed while streaming a pack leaves a hidden staging file in the store; gc
    deletes it once no write session is alive (and the grace period allows)."""
    store = ckstore.open(tmp_path / "s", create=True)
    store.take({"m": ckstore.StateDict(w=torch.zeros(4))}, run="r", step=1)
    out = store.repository.objects.backend.writer()
    out.write(b"half a pack")
    staged = [p for p in (tmp_path / "s").rglob(".writer-*")]
    assert len(staged) == 1
    assert store.gc(grace_seconds=3600).orphans_removed == 0  # too fresh: its writer may be alive
    os.utime(staged[0], (1, 1))
    assert store.gc(grace_seconds=3600).orphans_removed == 1
    assert not staged[0].exists() and store.check(read_data=True).ok
    store.close()


def _sparse_pack(url: Path) -> tuple[ckstore.Store, torch.Tensor]:
    """A store whose only pack is mostly dead: run ``a`` (deleted) and run ``b`` share it, and
    ``b`` keeps ``keep``; the open handle and ``keep``."""
    store = ckstore.open(
        url, chunk_bytes=1024, pack_bytes=64 * 1024, create=True, auto_compact=False
    )
    keep = torch.randn(64, 16)
    store.take({"s": ckstore.StateDict(keep=keep, big=torch.randn(128, 64))}, run="a")
    store.take({"s": ckstore.StateDict(keep=keep)}, run="b")
    store.delete("a")
    return store, keep


def test_a_gc_beside_another_does_not_delete_the_pack_the_other_is_rewriting_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gcs at once (a cron's and a job's): one rewrites a sparse pack, the other sweeps
    orphans after the new pack is written and before it is recorded. The rewrite runs inside
    a write session, so the sweep sees a writer alive and deletes nothing; before, it deleted
    the new pack, and the first gc pointed a kept snapshot's chunks at it."""
    url = tmp_path / "store"
    a, keep = _sparse_pack(url)
    b = ckstore.open(url, auto_compact=False)  # another process, in real life
    other = sweep_at_first_switch(monkeypatch, b)
    report = a.gc(grace_seconds=0, repack_below=0.5)
    monkeypatch.undo()
    assert report.packs_rewritten == 1
    assert other[0].orphans_removed == 0
    a.close()
    b.close()
    with ckstore.open(url) as store:
        assert torch.equal(store.get("b").read_object("s/keep"), keep)
        assert store.check(read_data=True).ok
    again = ckstore.open(url)
    try:
        assert again.gc(grace_seconds=0).orphans_removed == 0  # the session ended: no orphan
    finally:
        again.close()


def test_a_gc_whose_session_expired_records_no_rewritten_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gc paused past its lease (another gc may have deleted its new pack as an orphan by
    then) refuses to record the pack, and the snapshot still reads from the old one."""
    from ckstore.errors import LeaseExpiredError
    from ckstore.index.maintenance import Maintenance

    url = tmp_path / "store"
    a, keep = _sparse_pack(url)
    index = a.repository.index
    real = Maintenance.relocate_chunks

    def relocate(self: Maintenance, *args: Any, **kwargs: Any) -> int:
        for s in index.live_sessions():  # its lease ran out
            index.end_session(s.id, "aborted")
        return real(self, *args, **kwargs)

    rows = {c.chunk_id: c.pack_id for c in index.all_chunks()}
    packs = {p for p, _, _ in index.local_packs_by_use()}
    monkeypatch.setattr(Maintenance, "relocate_chunks", relocate)
    with pytest.raises(LeaseExpiredError):
        a.gc(grace_seconds=0, repack_below=0.5)
    monkeypatch.setattr(Maintenance, "relocate_chunks", real)
    # the rewritten pack was not recorded: every row still names the pack it was in
    kept = {c.chunk_id: c.pack_id for c in index.all_chunks()}
    assert {i: rows[i] for i in kept} == kept
    assert {p for p, _, _ in index.local_packs_by_use()} <= packs
    assert torch.equal(a.get("b").read_object("s/keep"), keep)
    a.close()


def test_two_gcs_dropping_the_same_snapshot_both_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention gc that finds a snapshot it selected already deleted (by another gc between
    its listing and its delete) takes it as done and goes on; before, it raised
    SnapshotNotFoundError and stopped before its repack and its sweep."""
    url = tmp_path / "store"
    a = ckstore.open(url, create=True, auto_compact=False)
    for step in range(3):
        a.take({"s": ckstore.StateDict(w=torch.full((64,), float(step)))}, run="r", step=step)
    b = ckstore.open(url, auto_compact=False)
    index = a.repository.index
    real = index.delete_snapshot
    first = index.list_snapshots(run="r", limit=3)[-1]  # step 0, the oldest

    def delete_snapshot(snapshot_id: str, **kwargs: Any) -> None:
        if snapshot_id == first.id:
            b.delete(first.id)  # the other gc's
        real(snapshot_id, **kwargs)

    monkeypatch.setattr(index, "delete_snapshot", delete_snapshot)
    report = a.gc(keep_last=1, grace_seconds=0)
    assert report.snapshots_dropped == ["r@1"]
    assert [s.step for s in a.log(run="r")] == [2]
    assert torch.equal(a.get("r@2").read_object("s/w"), torch.full((64,), 2.0))
    a.close()
    b.close()


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def test_a_snapshot_tagged_while_gc_plans_its_retention_is_kept_with_its_tag(
    tmp_path, dialect, request
):
    """gc lists the tags once, then deletes what its policy drops. Before, a tag another handle
    set in between (its call returned) was deleted with the snapshot it named, in silence."""
    url = str(tmp_path / "store")
    index = "" if dialect == "sqlite" else request.getfixturevalue("pg").new_database()
    store = ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True)
    for step in range(1, 6):
        store.take({"s": ckstore.StateDict(state_for(step))}, run="r", step=step)
    other = ckstore.open(url, index=index or None)  # another process tags r@2 to keep it
    gc_index = store.repository.index
    real = gc_index.list_tags

    def listed_then_tagged_elsewhere():
        tags = real()  # what gc's retention saw: no tag yet
        other.tag("r@2", "keep-me")
        return tags

    gc_index.list_tags = listed_then_tagged_elsewhere
    try:
        report = store.gc(keep_last=2, grace_seconds=0)
    finally:
        gc_index.list_tags = real
    assert other.tags()["keep-me"] == store.get("r@2").id
    assert [s.step for s in store.log()] == [5, 4, 2]
    assert sorted(report.snapshots_dropped) == ["r@1", "r@3"] and report.snapshots_kept == 3
    got = store.get("keep-me").read_object("s")
    assert all(torch.equal(got[k], v) for k, v in state_for(2).items())
    assert store.check(read_data=True).ok
    other.close()
    store.close()
