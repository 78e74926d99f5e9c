"""Compaction where snapshots are not in the order they started: takes that commit out of order
(many hosts into one run), and snapshots dropped by a gc while compaction plans.

Takes into one run may commit in another order than they started in: a run's parent is its
newest snapshot at commit time, so the take that started first and committed last has a parent
newer than itself. Compaction takes delta bases from parents, oldest snapshot first; it must
never plan a chain that comes back to where it started (a cycle no reader can decode).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.lease import Lease
from ckstore.engine.take import local as local_take
from ckstore.index import ChunkRecord, PackRecord
from tests.support.deltas import KNOBS, App, restores

BASE = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))


def _state(seed: int) -> dict[str, torch.Tensor]:
    """A state near BASE (deltas pay), different for each seed."""
    g = torch.Generator().manual_seed(seed)
    return {"w": BASE + 1e-3 * torch.randn(64, 96, generator=g)}


def _out_of_order(
    path: Path, monkeypatch: pytest.MonkeyPatch, **open_kw: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """Three takes into run ``r``, started A, P, B and committed P, B, A (each its own store
    handle, as on three hosts). A and P hold the same tensor (two ranks of a job that restarted
    from one state), B another. Parents: B's is P, A's is B, so compaction (oldest first: A, P,
    B) plans A's chunks against B's and B's against P's, which are A's. Returns name -> state."""
    real = local_take.commit_manifest
    gates: dict[str, threading.Event] = {}
    errors: list[BaseException] = []

    def held(*a: Any, **kw: Any) -> Any:
        gate = gates.get(threading.current_thread().name)
        if gate is not None:
            assert gate.wait(60), "the test never let the take commit"
        return real(*a, **kw)

    monkeypatch.setattr(local_take, "commit_manifest", held)
    states = {"A": _state(1), "P": _state(1), "B": _state(3)}

    def take(name: str, step: int) -> None:
        try:
            with ckstore.open(path, **open_kw) as store:
                store.take({"m": App(dict(states[name]))}, run="r", step=step)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = []
    for step, name in enumerate(("A", "P", "B"), start=1):
        gates[name] = threading.Event()
        threads.append(threading.Thread(target=take, args=(name, step), name=name))
        threads[-1].start()
        time.sleep(0.3)  # started in this order (created_at is when a take starts)
    for name, thread in zip(("P", "B", "A"), (threads[1], threads[2], threads[0])):
        gates[name].set()
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.05)
    monkeypatch.setattr(local_take, "commit_manifest", real)
    assert not errors, errors
    return states


def _readable(store: ckstore.Store, states: dict[str, dict[str, torch.Tensor]]) -> None:
    by_step = {1: "A", 2: "P", 3: "B"}
    for snap in store.log(run="r"):
        if snap.step in by_step:
            assert restores(store, snap.id, states[by_step[snap.step]]), snap.step
    report = store.check(read_data=True)
    assert report.ok, report.problems


@pytest.mark.parametrize("delta_depth", [2, 3])
def test_takes_that_commit_out_of_order_compact_without_a_delta_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta_depth: int
) -> None:
    path = tmp_path / "s"
    ckstore.open(path, create=True, **KNOBS).close()
    states = _out_of_order(path, monkeypatch, delta_depth=delta_depth, auto_compact=False)
    with ckstore.open(path, delta_depth=delta_depth, auto_compact=False) as store:
        parents = {s.step: s.parent_id for s in store.log(run="r")}
        ids = {s.step: s.id for s in store.log(run="r")}
        assert parents[1] == ids[3] and parents[3] == ids[2]  # A's parent is newer than A
        report = store.compact(keep_loose=0)
        assert report.chunks > 0 and report.delta_chunks > 0
        _readable(store, states)
        index = store.repository.index
        rows = {c.chunk_id: c for c in index.all_chunks()}
        for cid in rows:  # every chain ends at a whole chunk within the depth limit
            seen = [cid]
            while rows[seen[-1]].base_id is not None:
                seen.append(rows[seen[-1]].base_id)
                assert seen[-1] not in seen[:-1], f"delta cycle {seen}"
            assert len(seen) - 1 == rows[cid].depth <= delta_depth


def test_auto_compaction_under_delta_depth_2_keeps_every_snapshot_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same takes in stores opened with ``delta_depth=2`` (auto-compaction on), then one more
    take: the background compaction it starts rewrites A, P and B by itself."""
    path = tmp_path / "s"
    ckstore.open(path, create=True, **KNOBS).close()
    states = _out_of_order(path, monkeypatch, delta_depth=2, auto_compact=True)
    with ckstore.open(path, delta_depth=2, auto_compact=True) as store:
        store.take({"m": App(_state(4))}, run="r", step=4)
        assert store.wait_compacted(timeout=120)
        compacted = store.repository.index.loose_chunks()
        assert not {c.chunk_id for c in compacted} & {
            c
            for s in (1, 2, 3)
            for c in store.repository.index.snapshot_chunk_ids(store.get(f"r@{s}").id)
        }
        _readable(store, states)
        assert restores(store, "r@4", _state(4))


def test_the_index_refuses_a_delta_against_a_chunk_that_leads_back(tmp_path: Path) -> None:
    """Two compactions (two hosts) planned from the same rows, the other way round: the first
    stores ``a`` as a delta against ``b``; the second's ``b`` against ``a`` is refused (``b``
    stays as it is: a delta is stored against it), so no cycle is ever stored."""
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        store.take({"m": App(_state(1))}, run="r", step=1)
        store.take({"m": App(_state(2))}, run="r", step=2)
        index = store.repository.index
        a_id = sorted(index.snapshot_chunk_ids(store.get("r@1").id))[0]
        b_id = sorted(index.snapshot_chunk_ids(store.get("r@2").id))[0]
        rows = index.chunk_locations([a_id, b_id])
        a, b = rows[a_id], rows[b_id]

        def delta(rec: ChunkRecord, base: ChunkRecord) -> ChunkRecord:
            return ChunkRecord(
                rec.chunk_id, "f" * 64, 0, rec.length, rec.raw_length, "xor-zstd", base.chunk_id, 1
            )

        with Lease(index, 600) as lease:
            pack = PackRecord("f" * 64, 1, 2, time.time())
            assert index.rewrite_chunks(lease.id, pack, [(delta(a, b), a.pack_id)]) == [a_id]
            assert index.rewrite_chunks(lease.id, pack, [(delta(b, a), b.pack_id)]) == []
            assert index.rewrite_chunks(lease.id, pack, [(delta(b, b), b.pack_id)]) == []
        now = index.chunk_locations([a_id, b_id])
        assert now[a_id].base_id == b_id and now[a_id].depth == 1
        assert now[b_id].base_id is None and now[b_id].pack_id == b.pack_id


def test_a_compaction_beside_a_gc_that_drops_a_snapshot_while_it_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc in another process drops older snapshots between compaction's query of the snapshots
    that use loose chunks and its reading of each: those are skipped, the rest is compacted."""
    path = tmp_path / "s"
    with ckstore.open(path, create=True, auto_compact=False, **KNOBS) as store:
        for step in range(1, 6):
            store.take({"m": App(_state(step))}, run="r", step=step)
        index = store.repository.index
        real = type(index).referencing_snapshots

        def then_gc(self: Any, chunk_ids: Any) -> set[str]:
            found = real(self, chunk_ids)
            with ckstore.open(path, auto_compact=False) as other:
                assert len(other.gc(keep_last=2, grace_seconds=3600).snapshots_dropped) == 3
            return found

        monkeypatch.setattr(type(index), "referencing_snapshots", then_gc)
        report = store.compact(keep_loose=1)
        monkeypatch.undo()
        assert report.snapshots == 1 and report.chunks > 0  # r@4: r@5 stays loose
        assert [s.step for s in store.log(run="r")] == [5, 4]
        assert restores(store, "r@4", _state(4)) and restores(store, "r@5", _state(5))
        assert store.check(read_data=True).ok


def test_a_pull_of_an_older_snapshot_into_a_run_compacts_without_a_delta_cycle(
    tmp_path: Path,
) -> None:
    """A pull keeps a snapshot's time but commits it after the run's newest here: A, taken
    elsewhere before P and B were taken here, arrives with B as its parent."""
    kw: dict[str, Any] = {"delta_depth": 2, "auto_compact": False, **KNOBS}
    states = {"A": _state(1), "P": _state(1), "B": _state(3)}
    with ckstore.open(tmp_path / "there", create=True, **kw) as there:
        there.take({"m": App(dict(states["A"]))}, run="r", step=1)
    with ckstore.open(tmp_path / "here", create=True, **kw) as here:
        here.take({"m": App(dict(states["P"]))}, run="r", step=2)
        here.take({"m": App(dict(states["B"]))}, run="r", step=3)
        here.add_remote("there", tmp_path / "there")
        here.pull("there", ["r@1"])
        ids = {s.step: s.id for s in here.log(run="r")}
        assert here.get("r@1").parent_id == ids[3]
        assert here.compact(keep_loose=0).delta_chunks > 0
        _readable(here, states)
