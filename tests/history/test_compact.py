"""Compaction: takes write loose (fast codec, no deltas); older snapshots are rewritten densely.

What a user relies on: every snapshot restores bit-exactly before, during and after compaction
(whatever its chains), the newest snapshot of each run stays in the fast form, the bytes shrink,
gc reclaims the loose packs, and compaction is safe beside takes, restores and gc.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.restore.reader import Reader
from ckstore.history.compact import loose_pending
from tests.support.deltas import App, restores

KNOBS: dict[str, Any] = {"chunk_bytes": 4096, "pack_bytes": 32768, "inline_bytes": 64}


def _run(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A drifting training run: fp32 weights and moments, bf16 weights, ints that never change."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g)
    m = torch.randn(64, 96, generator=g).abs() * 1e-3
    ids = torch.randint(0, 1000, (32, 32), generator=g)
    out = []
    for i in range(steps):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        m = 0.9 * m + 0.1 * torch.randn(m.shape, generator=g).square() * 1e-3
        out.append(
            {
                "w": w.clone(),
                "m": m.clone(),
                "wb": w.to(torch.bfloat16),
                "ids": ids,
                "step": torch.tensor(i),
            }
        )
    return out


def _take_all(
    store: ckstore.Store, states: list[dict[str, torch.Tensor]], run: str = "r"
) -> list[str]:
    return [store.take({"m": App(dict(s))}, run=run, step=i).id for i, s in enumerate(states)]


def _loose(store: ckstore.Store) -> set[str]:
    return {
        c.chunk_id for c in store.repository.index.loose_chunks() if c.codec in objects.FAST_CODECS
    }


def _pack_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "packs").rglob("*.pack"))


def _codecs(store: ckstore.Store, snap_id: str) -> set[str]:
    rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
    return {rows[cid].codec for cid in store.repository.index.snapshot_chunk_ids(snap_id)}


def test_takes_write_loose_and_compaction_rewrites_all_but_the_newest(tmp_path: Path) -> None:
    states = _run(5)
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=False, take_codec="fast", **KNOBS
    ) as store:
        ids = _take_all(store, states)
        assert _codecs(store, ids[0]) <= objects.FAST_CODECS and "exp-zstd" in _codecs(
            store, ids[0]
        )
        before = sum(store.get(i).stats["new_bytes"] for i in ids)
        dry = store.compact(dry_run=True)
        assert (
            dry.dry_run and dry.chunks > 0 and dry.snapshots == 4 and _loose(store)
        )  # nothing changed
        on_disk = _pack_bytes(tmp_path / "s")
        report = store.compact()
        assert (report.chunks, report.snapshots) == (dry.chunks, 4) and report.delta_chunks > 0
        assert 0 < report.dense_bytes < report.loose_bytes and report.packs_written > 0
        # the loose packs it emptied are gone at once: the disk holds each state once, not twice
        assert report.packs_deleted == report.packs_retired > 0
        assert (
            _pack_bytes(tmp_path / "s") < on_disk - (report.loose_bytes - report.dense_bytes) // 2
        )
        assert _loose(store) <= store.repository.index.snapshot_chunk_ids(
            ids[-1]
        )  # the newest stays loose
        assert "exp-zstd" in _codecs(store, ids[-1]) and "xor-bytegroup-zstd" in _codecs(
            store, ids[1]
        )
        assert (
            not loose_pending(store.repository) and store.compact().chunks == 0
        )  # nothing left to do
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok
        gc = store.gc(grace_seconds=0)
        assert gc.packs_removed > 0
        stored = sum(c.length for c in store.repository.index.all_chunks())
        assert stored < 0.9 * before, (stored, before)
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_compacting_after_every_take_keeps_chains_within_the_depth_limit(tmp_path: Path) -> None:
    """What auto-compaction does in a training loop: each take makes its parent cold."""
    states = _run(7)
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=False, delta_depth=1, **KNOBS
    ) as store:
        ids = []
        for i, s in enumerate(states):
            ids.append(store.take({"m": App(dict(s))}, run="r", step=i).id)
            store.compact()
        depths = [c.depth for c in store.repository.index.all_chunks()]
        assert max(depths) == 1 and depths.count(1) > 0
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        store.gc(
            keep_last=2, grace_seconds=0
        )  # a base's snapshot gone: the base stays while needed
        for i, s in list(zip(ids, states))[-2:]:
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_keep_loose_and_several_runs(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        a = _take_all(store, _run(3, seed=1), run="a")
        b = _take_all(store, _run(3, seed=2), run="b")
        store.compact(keep_loose=2)
        assert _loose(store) == set().union(
            *(store.repository.index.snapshot_chunk_ids(i) for i in a[1:] + b[1:])
        )
        store.compact(keep_loose=0)
        assert not _loose(store)
        for ids, seed in ((a, 1), (b, 2)):
            for i, s in zip(ids, _run(3, seed=seed)):
                assert restores(store, i, s)
        with pytest.raises(ckstore.InvalidInputError, match="keep_loose"):
            store.compact(keep_loose=-1)


def test_a_base_of_a_take_time_delta_stays_whole(tmp_path: Path) -> None:
    """A take with delta_base="parent" stores deltas against loose chunks: compacting those
    must not turn them into deltas themselves (their dependents' chains would grow)."""
    states = _run(3)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        first = store.take({"m": App(dict(states[0]))}, run="r", step=0).id
        second = store.take({"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent").id
        third = store.take({"m": App(dict(states[2]))}, run="r", step=2).id
        store.compact(keep_loose=0)
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        bases = {c.base_id for c in rows.values() if c.base_id}
        assert bases and all(rows[b].depth == 0 and rows[b].base_id is None for b in bases)
        for i, s in zip((first, second, third), states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_parent_deltas_wait_for_compaction_when_it_runs_after_takes(tmp_path: Path) -> None:
    """With compaction after takes, delta_base="parent" costs the take nothing: the take writes
    loose and whole, and compaction stores the older snapshot as deltas against its parent
    (against a dense keyframe). Without it (auto_compact off, or dense takes) the take deltas."""
    states = _run(3)
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=True, delta_base="parent", **KNOBS
    ) as store:
        assert store.repository.compacts_later
        ids = [store.take({"m": App(dict(s))}, run="r", step=i).id for i, s in enumerate(states)]
        assert store.wait_compacted(timeout=60)
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        newest = store.repository.index.snapshot_chunk_ids(ids[-1])
        assert all(
            rows[c].base_id is None and rows[c].codec in objects.FAST_CODECS
            for c in newest
            if c not in store.repository.index.snapshot_chunk_ids(ids[-2])
        )
        middle = store.repository.index.snapshot_chunk_ids(
            ids[1]
        ) - store.repository.index.snapshot_chunk_ids(ids[0])
        assert any(rows[c].base_id for c in middle)  # compaction made the deltas
        for i, s in zip(ids, states):
            assert restores(store, i, s)
    for knobs in ({"auto_compact": False}, {"auto_compact": True, "take_codec": "dense"}):
        with ckstore.open(
            tmp_path / str(knobs), create=True, delta_base="parent", **knobs, **KNOBS
        ) as store:
            assert not store.repository.compacts_later
            for i, s in enumerate(states[:2]):
                snap = store.take({"m": App(dict(s))}, run="r", step=i)
            rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
            assert any(rows[c].base_id for c in store.repository.index.snapshot_chunk_ids(snap.id))


def test_auto_compaction_after_takes_waits_while_busy(tmp_path: Path) -> None:
    states = _run(4)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=True, **KNOBS) as store:
        ids = _take_all(store, states[:2])
        assert store.wait_compacted(timeout=60)
        assert _loose(store) <= store.repository.index.snapshot_chunk_ids(ids[-1])
        with store.repository.activity():  # a take or restore of this process runs
            ids.append(store.take({"m": App(dict(states[2]))}, run="r", step=2).id)
            time.sleep(0.3)
            assert not store.wait_compacted(timeout=0.2)  # waiting for the activity to end
            assert loose_pending(store.repository)
        assert store.wait_compacted(timeout=60) and not loose_pending(store.repository)
        store.auto_compact = False
        ids.append(store.take({"m": App(dict(states[3]))}, run="r", step=3).id)
        assert store.wait_compacted(timeout=1) and loose_pending(store.repository)
        for i, s in zip(ids, states):
            assert restores(store, i, s)


def test_quiesce_ends_the_thread_and_the_next_take_starts_it_again(tmp_path: Path) -> None:
    """A trainer's teardown checks that no thread outlives it: quiesce lets the background
    compaction finish and ends its thread; the store stays open and the next take compacts."""
    states = _run(4)
    others = {t.ident for t in threading.enumerate()}  # other tests' stores, not this one's

    def threads() -> list[str]:
        return [
            t.name
            for t in threading.enumerate()
            if t.name == "ckstore-compact" and t.ident not in others
        ]

    with ckstore.open(tmp_path / "s", create=True, auto_compact=True, **KNOBS) as store:
        ids = _take_all(store, states[:3])
        assert store.quiesce(timeout=60) and threads() == []
        assert not loose_pending(store.repository)  # it finished its work first
        ids.append(store.take({"m": App(dict(states[3]))}, run="r", step=3).id)
        assert store.wait_compacted(timeout=60) and threads() == ["ckstore-compact"]
        assert store.quiesce() and threads() == []
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        # a framework that polices leftover daemon threads calls their stop(): it quiesces
        store.take({"m": App(dict(states[0]))}, run="r", step=4)
        (thread,) = [t for t in threading.enumerate() if t.name == "ckstore-compact"]
        thread.stop()  # type: ignore[attr-defined]
        assert not thread.is_alive() and threads() == []
        assert not loose_pending(store.repository)
    thread.stop()  # type: ignore[attr-defined]  # after close: returns at once


def test_a_reclaim_behind_with_auto_compaction_off_gives_the_space_back_and_ends_its_thread(
    tmp_path: Path,
) -> None:
    """``reclaim_behind`` runs the gc on the compaction thread; with auto-compaction off no
    take kicks that thread again, so once the gc ran it ends (a store opened by URL and never
    closed, as ``dcp.save`` opens one, keeps no idle thread)."""
    states = _run(3)
    others = {t.ident for t in threading.enumerate()}

    def threads() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.name == "ckstore-compact" and t.ident not in others
        ]

    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        ids = _take_all(store, states)
        store.delete(ids[0])
        store.reclaim_behind()
        assert store.wait_compacted(timeout=60)
        for t in threads():
            t.join(timeout=10)
        assert threads() == []
        assert store.gc(dry_run=True).grace_kept_chunks == 0  # nothing left waiting
        for i, st in zip(ids[1:], states[1:]):
            assert restores(store, i, st)
        store.reclaim_behind()  # a second one starts a thread again, and it ends again
        assert store.wait_compacted(timeout=60)
        for t in threads():
            t.join(timeout=10)
        assert threads() == []


def test_compaction_beside_takes_restores_and_gc(tmp_path: Path) -> None:
    """Threads of one process (each its own store handle, as separate hosts would): takes into
    one run, restores of everything committed, check and numeric diffs (readers that do not
    restore), gc with no grace, compaction in a loop (which deletes the loose packs it empties at
    once). Nothing is lost or wrong, no check reports a problem, and check is clean afterwards."""
    path = tmp_path / "s"
    ckstore.open(path, create=True, **KNOBS).close()
    states = _run(8)
    committed: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def worker(fn: Any) -> None:
        try:
            with ckstore.open(path, auto_compact=False, create=False) as store:
                fn(store)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            done.set()

    def taker(store: ckstore.Store) -> None:
        for i, s in enumerate(states):
            committed.append((store.take({"m": App(dict(s))}, run="r", step=i).id, i))
        done.set()

    def restorer(store: ckstore.Store) -> None:
        while not done.is_set():
            for sid, i in list(committed):
                assert restores(store, sid, states[i])

    def loop(fn: Any) -> Any:
        def run(store: ckstore.Store) -> None:
            while not done.is_set():
                fn(store)
                time.sleep(0.01)

        return run

    def checker(store: ckstore.Store) -> None:  # a pack emptied and deleted meanwhile is no damage
        while not done.is_set():
            report = store.check(read_data=True)
            assert report.ok, report.problems

    def differ(store: ckstore.Store) -> None:  # reads chunks whose packs compaction deletes
        while not done.is_set():
            if len(committed) >= 2:
                (a, _), (b, _) = committed[0], committed[-1]
                assert store.diff(a, b, numeric=True).changed

    threads = [
        threading.Thread(target=worker, args=(f,))
        for f in (
            taker,
            restorer,
            checker,
            differ,
            loop(lambda s: s.compact()),
            loop(lambda s: s.gc(grace_seconds=0)),
        )
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with ckstore.open(path, create=False) as store:
        store.compact()
        for sid, i in committed:
            assert restores(store, sid, states[i])
        assert store.check(read_data=True).ok


def test_a_restore_follows_a_chunk_compaction_rewrote_between_its_passes(tmp_path: Path) -> None:
    """An atomic restore checked a loose payload in its first pass; compaction then rewrote the
    chunk densely and gc deleted the loose pack: the second pass finds the chunk's new, different
    payload and verifies it before it touches the destination."""
    from ckstore.engine.restore.phases import apply, prepare

    states = _run(2)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        old = store.take({"m": App(dict(states[0]))}, run="r", step=0)
        store.take({"m": App(dict(states[1]))}, run="r", step=1)
        dest = {k: torch.zeros_like(v) for k, v in states[0].items()}
        reader = Reader.of(old.view)
        prepared = prepare(reader, {"m": App(dest)}, budget=0)  # nothing staged: all read again
        assert store.compact().chunks > 0
        assert store.gc(grace_seconds=0).packs_removed > 0
        apply(prepared, reader)
        assert all(torch.equal(dest[k], v) for k, v in states[0].items())


@pytest.mark.parametrize("atomic", [True, False])
def test_a_restore_follows_a_chunk_compaction_rewrote_after_it_was_located(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """A restore located its chunks in their loose packs; compaction then rewrote them densely
    and gc deleted the loose packs before the first read: each read looks its chunk up again and
    reads it at its new place."""
    from ckstore.engine.restore.fetch import Fetcher

    states = _run(2)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        old = store.take({"m": App(dict(states[0]))}, run="r", step=0)
        store.take({"m": App(dict(states[1]))}, run="r", step=1)
        real = Fetcher._locate
        moved: list[int] = []

        def locate_then_compact(self: Fetcher, jobs: Any) -> None:
            real(self, jobs)
            if not moved:
                moved.append(store.compact().chunks)
                assert store.gc(grace_seconds=0).packs_removed > 0

        monkeypatch.setattr(Fetcher, "_locate", locate_then_compact)
        dest = {k: torch.zeros_like(v) for k, v in states[0].items()}
        store.get(old.id).restore({"m": App(dest)}, atomic=atomic, memory_budget=0)
        assert moved and moved[0] > 0
        assert all(torch.equal(dest[k], v) for k, v in states[0].items())


def test_compaction_on_every_deployment(any_store: ckstore.Store) -> None:
    states = _run(3)
    any_store.auto_compact = False
    ids = _take_all(any_store, states)
    report = any_store.compact()
    assert report.chunks > 0 and report.dense_bytes < report.loose_bytes
    any_store.gc(grace_seconds=0)
    for i, s in zip(ids, states):
        assert restores(any_store, i, s)
    assert any_store.check(read_data=True).ok


def test_dense_takes_write_no_loose_packs(tmp_path: Path) -> None:
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=False, take_codec="dense", **KNOBS
    ) as store:
        ids = _take_all(store, _run(2))
        assert not store.repository.index.loose_chunks() and store.compact().chunks == 0
        assert "bytegroup-zstd" in _codecs(store, ids[0])
        with pytest.raises(ckstore.InvalidInputError, match="take_codec"):
            store.take_codec = "fastest"


def test_raw_takes_store_chunks_as_they_are_and_compaction_packs_them(tmp_path: Path) -> None:
    states = _run(3)
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=False, take_codec="raw", **KNOBS
    ) as store:
        ids = _take_all(store, states)
        assert _codecs(store, ids[0]) == {"none"}  # no encoding work on the critical path
        loose = sum(store.get(i).stats["new_bytes"] for i in ids)
        report = store.compact()
        assert report.chunks > 0 and report.dense_bytes < 0.8 * report.loose_bytes
        assert _codecs(store, ids[-1]) == {"none"} and "xor-bytegroup-zstd" in _codecs(
            store, ids[1]
        )
        assert sum(c.length for c in store.repository.index.all_chunks()) < loose
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_cli_compact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ckstore import cli

    states = _run(3)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        ids = _take_all(store, states)
    assert cli.main(["--store", str(tmp_path / "s"), "--json", "compact", "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and dry["chunks"] > 0 and dry["snapshots"] == 2
    assert cli.main(["--store", str(tmp_path / "s"), "compact", "--keep-loose", "0"]) == 0
    out = capsys.readouterr().out
    assert "chunks:" in out and "delta_chunks:" in out and "packs_deleted:" in out
    with ckstore.open(tmp_path / "s", create=False) as store:
        assert not _loose(store)
        for i, s in zip(ids, states):
            assert restores(store, i, s)


def test_check_and_numeric_diff_across_a_compaction_that_deletes_their_packs(
    tmp_path: Path, monkeypatch
) -> None:
    """Compaction switches chunks and deletes the loose packs between a check's (or a numeric
    diff's) reading of the index and its reading of the packs: neither reports damage, while a
    pack that really went missing is still reported."""
    states = _run(3)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        ids = _take_all(store, states)
        index = store.repository.index
        real = type(index).all_chunks

        def then_compact(self: Any) -> Any:
            rows = real(self)
            monkeypatch.setattr(type(index), "all_chunks", real)
            assert store.compact().packs_deleted > 0
            return rows

        monkeypatch.setattr(type(index), "all_chunks", then_compact)
        report = store.check(read_data=True)
        assert report.ok, report.problems
        diff = store.diff(
            ids[0], ids[1], numeric=True
        )  # located loose, compacted above: follows the move
        assert diff.changed
        victim = next(iter({c.pack_id for c in index.all_chunks()}))
        (tmp_path / "s" / objects.pack_name(victim)).unlink()
        assert {p.kind for p in store.check().problems} == {"missing-pack"}


def test_a_take_whose_delta_base_is_compacted_before_it_commits_stays_readable(
    tmp_path: Path,
) -> None:
    """A take stores deltas against a stored snapshot (``delta_base=<id>``, a fine-tune from a
    base model) while a compaction of another process re-encodes that snapshot's chunks as
    deltas, between the take's choice of its bases and its commit. The take's deltas are
    recorded one deeper than their bases are now; before, they kept the depth of when the take
    chose them, and the reader refused each such chain: the committed snapshot was lost."""
    url = tmp_path / "s"
    states = _run(4)
    with ckstore.open(url, create=True, auto_compact=False, **KNOBS) as store:
        ids = [
            store.take({"m": App(dict(s))}, run="base", step=i).id for i, s in enumerate(states[:3])
        ]
        other = ckstore.open(url, auto_compact=False)  # the compacting process
        index = store.repository.index
        real = index.commit_snapshot
        reports: list[Any] = []

        def commit_snapshot(*args: Any, **kwargs: Any) -> Any:
            if not reports:  # the take chose and pinned its bases and wrote its pack
                reports.append(other.compact())  # base@0 and base@1 are not the newest
            return real(*args, **kwargs)

        index.commit_snapshot = commit_snapshot  # type: ignore[method-assign]
        try:
            tuned = store.take({"m": App(dict(states[3]))}, run="ft", step=0, delta_base=ids[1]).id
        finally:
            index.commit_snapshot = real  # type: ignore[method-assign]
        other.close()
        assert reports[0].delta_chunks > 0
    with ckstore.open(url) as store:
        for i, sid in enumerate(ids):
            assert restores(store, sid, states[i])
        assert restores(store, tuned, states[3])
        assert store.check(read_data=True).ok
        # the compaction left the take's pinned bases whole: no chain outgrew the knob
        deepest = max(c.depth for c in store.repository.index.all_chunks())
        assert deepest <= store.repository.delta_depth
