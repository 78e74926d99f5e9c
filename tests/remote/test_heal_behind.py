"""A heal's write-back runs behind the read: the restore uses the fetched chunk's verified bytes
at once and the new local pack and its rows land on the store handle's write-back thread,
awaited at close and by whatever relies on the local copies (check, repair, gc, ...). A process
killed before its write-back landed loses nothing; a write-back that fails is warned at close
and the next read heals again; past the read's memory budget the heal is written first."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
import ckstore._heal_verbs as heal_verbs
import ckstore.remote.heal as remote_heal  # what the healer calls (imported on use)
from ckstore.objects.hashing import chunk_id
from tests.support.damage import flip
from tests.support.remotes import KNOBS, fill, restores, state_for

OPTS = {**KNOBS, "auto_compact": False}


def _store_with_backup(root: Path) -> ckstore.Store:
    store = ckstore.open(root / "local", create=True, **OPTS)
    fill(store, "r", [1])
    store.add_remote("backup", root / "backup")
    store.push("backup")
    return store


def _damage(store: ckstore.Store, root: Path, n: int) -> dict[str, str]:
    """Flip a bit in ``n`` whole chunks of r@1; their ids -> the pack each was in."""
    repo = store.repository
    rows = repo.index.chunk_locations(repo.index.snapshot_chunk_ids(store.get("r@1").id))
    hit = sorted(c for c, r in rows.items() if r.base_id is None and r.length >= 8)[:n]
    for cid in hit:
        flip(root / "local", rows[cid])
    return {cid: rows[cid].pack_id for cid in hit}


def _gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every write-back until the event is set."""
    release = threading.Event()
    real = remote_heal.write_back

    def gated(*args: Any) -> Any:
        assert release.wait(60)
        return real(*args)

    monkeypatch.setattr(remote_heal, "write_back", gated)
    return release


def _packs(store: ckstore.Store, ids: dict[str, str]) -> dict[str, str]:
    return {c: r.pack_id for c, r in store.repository.index.chunk_locations(list(ids)).items()}


def test_the_restore_returns_before_the_write_back_lands_and_check_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _gate(monkeypatch)
    store = _store_with_backup(tmp_path)
    try:
        hit = _damage(store, tmp_path, 3)
        with pytest.warns(ckstore.HealedWarning, match=r"3 damaged chunk\(s\).*backup"):
            assert restores(store, "r@1", 1)  # bit-exact while every write-back is held
        assert _packs(store, hit) == hit  # the rows still name the damaged packs
        assert store.repository.write_backs.pending(hit)
        threading.Timer(0.2, release.set).start()
        assert store.check(read_data=True).ok  # waits for the write-back, then judges
        assert set(_packs(store, hit).values()).isdisjoint(hit.values())
    finally:
        release.set()
        store.close()


def test_repair_waits_for_the_write_back_instead_of_healing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _gate(monkeypatch)
    store = _store_with_backup(tmp_path)
    try:
        _damage(store, tmp_path, 2)
        with pytest.warns(ckstore.HealedWarning):
            assert restores(store, "r@1", 1)
        threading.Timer(0.2, release.set).start()
        report = store.repair()
        assert report.ok and report.healed == {}, report.to_dict()
    finally:
        release.set()
        store.close()


def test_a_second_restore_before_the_write_back_lands_uses_the_landed_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _gate(monkeypatch)
    fetched: list[list[str]] = []
    real = remote_heal.fetch

    def counting(repo: Any, chunk_ids: Any, *args: Any, **kw: Any) -> Any:
        fetched.append(list(chunk_ids))
        return real(repo, chunk_ids, *args, **kw)

    monkeypatch.setattr(remote_heal, "fetch", counting)
    store = _store_with_backup(tmp_path)
    try:
        hit = _damage(store, tmp_path, 2)
        with pytest.warns(ckstore.HealedWarning):
            assert restores(store, "r@1", 1)
        threading.Timer(0.2, release.set).start()
        assert restores(store, "r@1", 1)  # waits for the landing rather than fetching again
        assert sorted(c for ids in fetched for c in ids) == sorted(hit)
    finally:
        release.set()
        store.close()


def test_a_failed_write_back_is_warned_at_close_and_the_next_read_heals_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise ckstore.NoSpaceError("the disk is full")

    monkeypatch.setattr(remote_heal, "write_back", broken)
    store = _store_with_backup(tmp_path)
    hit = _damage(store, tmp_path, 2)
    with pytest.warns(ckstore.HealedWarning):
        assert restores(store, "r@1", 1)
    with pytest.warns(
        ckstore.WriteBackWarning, match=r"1 write-back\(s\).*r@1.*2 chunk\(s\).*disk is full"
    ) as seen:
        store.close()
    assert all(c[:16] in str(seen[0].message) for c in hit)
    monkeypatch.undo()
    with ckstore.open(tmp_path / "local") as again:
        assert not again.check(read_data=True).ok  # nothing claimed sound that is not
        with pytest.warns(ckstore.HealedWarning, match=r"2 damaged chunk\(s\)"):
            assert restores(again, "r@1", 1)
    with ckstore.open(tmp_path / "local") as after:
        assert after.check(read_data=True).ok


def test_past_the_memory_budget_the_heal_is_written_before_the_read_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted: list[int] = []
    store = _store_with_backup(tmp_path)
    real = store.repository.write_backs.submit

    def counting(keys: Any, *args: Any) -> None:
        submitted.append(len(list(keys)))
        real(keys, *args)

    monkeypatch.setattr(store.repository.write_backs, "submit", counting)
    try:
        hit = _damage(store, tmp_path, 2)
        want = state_for(1)
        out = {"m": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
        with pytest.warns(ckstore.HealedWarning, match=r"2 damaged chunk\(s\)"):
            store.get("r@1").restore(out, memory_budget=1)  # room for no chunk
        assert all(torch.equal(out["m"][k], v) for k, v in want.items())
        assert submitted == []  # nothing left behind: written before the read went on
        assert set(_packs(store, hit).values()).isdisjoint(hit.values())
        assert restores(store, "r@1", 1)
    finally:
        store.close()


def _restore_then_die(local: str, written: Any) -> None:
    """Restore r@1 (healing it) with every write-back held, say so, and die by SIGKILL."""
    gate = threading.Event()
    real = remote_heal.write_back

    def held(*args: Any) -> Any:
        gate.wait()
        return real(*args)

    remote_heal.write_back = held  # type: ignore[assignment]
    store = ckstore.open(local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = restores(store, "r@1", 1)
    written.value = 1 if ok else 2
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_before_its_write_back_landed_loses_nothing(tmp_path: Path) -> None:
    store = _store_with_backup(tmp_path)
    hit = _damage(store, tmp_path, 3)
    store.close()
    ctx = multiprocessing.get_context("fork")
    restored = ctx.Value("i", 0)
    proc = ctx.Process(target=_restore_then_die, args=(str(tmp_path / "local"), restored))
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == -signal.SIGKILL and restored.value == 1
    with ckstore.open(tmp_path / "local") as store:
        assert _packs(store, hit) == hit  # never switched: still the damaged copies here
        assert not store.check(read_data=True).ok
        with pytest.warns(ckstore.HealedWarning, match=r"3 damaged chunk\(s\).*backup"):
            assert restores(store, "r@1", 1)  # the remote still holds them: healed again
    with ckstore.open(tmp_path / "local") as store:
        assert store.check(read_data=True).ok


def test_whole_chunks_are_fetched_in_parallel_each_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    release = threading.Event()
    real = remote_heal.fetch

    def gated(repo: Any, chunk_ids: Any, *args: Any, **kw: Any) -> Any:
        calls.append(list(chunk_ids))
        if len(calls) == 1:
            assert release.wait(30)
        return real(repo, chunk_ids, *args, **kw)

    monkeypatch.setattr(remote_heal, "fetch", gated)
    store = _store_with_backup(tmp_path)
    try:
        a, b, c = _damage(store, tmp_path, 3)
        healer = heal_verbs.RestoreHealer(store.get("r@1").view)
        results: dict[str, list[Any]] = {a: [], b: [], c: []}
        ask = [threading.Thread(target=lambda x=x: results[x].append(healer(x))) for x in (a, a)]
        ask[0].start()
        while not calls:
            time.sleep(0.01)
        ask[1].start()  # the same chunk: waits for the first fetch of it
        others = [threading.Thread(target=lambda x=x: results[x].append(healer(x))) for x in (b, c)]
        for t in others:
            t.start()
        for t in others:
            t.join(30)
        assert len(results[b]) == 1 and len(results[c]) == 1 and not results[a]  # not held up
        release.set()
        for t in ask:
            t.join(30)
        assert calls == [[a], [b], [c]] or calls == [[a], [c], [b]]  # each fetched once
        for cid, got in results.items():  # bytes verified against the id asked for
            assert all(chunk_id(bytes(raw)) == cid for raw in got)
        assert len(results[a]) == 2
        with pytest.warns(ckstore.HealedWarning, match=r"3 damaged chunk\(s\)"):
            healer.report()
        assert store.check(read_data=True).ok
    finally:
        release.set()
        store.close()


def test_a_remote_that_cannot_be_read_is_named_not_taken_for_one_that_lacks_the_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.remote import config

    def down(*args: Any, **kw: Any) -> Any:
        raise ckstore.StorageError("the share is not mounted")

    store = _store_with_backup(tmp_path)
    try:
        _damage(store, tmp_path, 2)
        monkeypatch.setattr(config, "open_remote", down)
        unread = r"could not be opened or read: 'backup' \(StorageError: the share is not mounted\)"
        with pytest.raises(ckstore.CorruptionError, match=r"no remote that could be read") as got:
            restores(store, "r@1", 1)
        assert "could not be opened or read: 'backup'" in str(got.value)
        with pytest.raises(ckstore.CorruptionError, match=unread):
            store.get("r@1").read_object("m")
        report = store.repair()
        assert not report.ok and len(report.unrecoverable) == 2
        assert report.unreachable == {"backup": "StorageError: the share is not mounted"}
        assert report.to_dict()["unreachable"] == report.unreachable
        monkeypatch.undo()  # the share is back: the same chunks heal
        with pytest.warns(ckstore.HealedWarning, match=r"2 damaged chunk\(s\).*backup"):
            assert restores(store, "r@1", 1)
    finally:
        store.close()


def test_a_chunk_damaged_again_after_its_write_back_landed_heals_again(tmp_path: Path) -> None:
    store = _store_with_backup(tmp_path)
    try:
        hit = _damage(store, tmp_path, 1)
        with pytest.warns(ckstore.HealedWarning, match=r"1 damaged chunk\(s\)"):
            assert restores(store, "r@1", 1)
        store.repository.write_backs.wait()
        cid = next(iter(hit))
        flip(tmp_path / "local", store.repository.index.chunk_locations([cid])[cid])
        with pytest.warns(ckstore.HealedWarning, match=rf"1 damaged chunk\(s\).*{cid[:16]}"):
            assert restores(store, "r@1", 1)
        assert store.check(read_data=True).ok
    finally:
        store.close()


def test_without_a_remote_a_chunk_asked_twice_is_refused_twice(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1])
        (cid,) = _damage(store, tmp_path, 1)
        healer = heal_verbs.RestoreHealer(store.get("r@1").view)
        asked = threading.Thread(target=lambda: [healer(cid), healer(cid)], daemon=True)
        asked.start()
        asked.join(30)
        assert not asked.is_alive(), "the second ask waited for a fetch that never ran"
        assert healer(cid) is False
    finally:
        store.close()


def test_a_gc_beside_a_write_back_does_not_delete_the_pack_it_lands_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write-back writes the healed chunks into a new pack, then switches their rows. A gc
    of another handle that sweeps orphans in between sees its write session alive and deletes
    nothing (the write-back's side of the race closed for repair and hydrate)."""
    from tests.support.gc_beside import sweep_at_first_switch

    store = _store_with_backup(tmp_path)
    other = ckstore.open(tmp_path / "local", **OPTS)
    try:
        hit = _damage(store, tmp_path, 2)
        swept = sweep_at_first_switch(monkeypatch, other)
        with pytest.warns(ckstore.HealedWarning):
            assert restores(store, "r@1", 1)
        store.repository.write_backs.wait()
        monkeypatch.undo()
        assert swept and swept[0].orphans_removed == 0
        assert set(_packs(store, hit).values()).isdisjoint(hit.values())  # landed, elsewhere
        assert store.check(read_data=True).ok
        assert restores(store, "r@1", 1)
    finally:
        other.close()
        store.close()
