"""The two-tier store (``ckstore.open(path, push_to=...)``): takes commit locally and return
while the uploader pushes in the background; ``push_status``, ``log`` and ``show`` tell local,
pushing and pushed; ``wait_pushed`` and a clean ``close`` wait; retention and gc keep what the
remote lacks; a local budget evicts pushed packs least recently used first and restores fetch
what was evicted, verified; a lost local tier restores from the remote bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore import errors, objects
from ckstore.remote import uploader as uploader_mod
from tests.support.gc_beside import sweep_at_first_switch
from tests.support.remotes import KNOBS, fill, fill_evicted, restores, same_history


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds every background push until the event is set (the test then sees ``pushing``)."""
    opened = threading.Event()
    real = uploader_mod.transfer

    def held(*args: Any, **kw: Any) -> Any:
        assert opened.wait(60), "the test never opened the gate"
        return real(*args, **kw)

    monkeypatch.setattr(uploader_mod, "transfer", held)
    yield opened
    opened.set()


def _cli(store: Path, *argv: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(store), *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_takes_return_while_the_uploader_pushes_and_states_follow(tmp_path, gate) -> None:
    remote_dir = tmp_path / "remote"
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(remote_dir), **KNOBS)
    try:
        snaps = fill(
            store, "r", [1, 2, 3], tags={3: ["best"]}
        )  # returns with the push held: local speed
        assert {s.state for s in store.push_status().values()} == {"pushing"}
        assert store.wait_pushed(timeout=0.2) is False
        assert [r["remote"]["state"] for r in _cli(tmp_path / "local", "log")] == ["pushing"] * 3
        assert _cli(tmp_path / "local", "show", "r@2")["remote"] == {
            "state": "pushing",
            "remotes": [],
        }
        gate.set()
        assert store.wait_pushed(timeout=60) is True
        status = store.push_status()
        assert {s.state for s in status.values()} == {"pushed"} and status[snaps[0].id].remotes == (
            "tier",
        )
        assert store.last_push is not None and store.last_push.stats.chunks_sent > 0
        shown = _cli(tmp_path / "local", "show", "r@2")["remote"]
        assert shown == {"state": "pushed", "remotes": ["tier"]}
        with ckstore.open(remote_dir) as remote:
            assert same_history(store, remote) and remote.check(read_data=True).ok
            assert all(restores(remote, f"r@{i}", i) for i in (1, 2, 3))
    finally:
        store.close()


def test_a_clean_close_waits_for_the_push(tmp_path, monkeypatch) -> None:
    real = uploader_mod.transfer

    def slow(*a: Any, **k: Any) -> Any:  # the push is still running when close() is called
        time.sleep(0.3)
        return real(*a, **k)

    monkeypatch.setattr(uploader_mod, "transfer", slow)
    with ckstore.open(
        tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **KNOBS
    ) as store:
        fill(store, "r", [1, 2])
    with ckstore.open(tmp_path / "remote") as remote, ckstore.open(tmp_path / "local") as local:
        assert same_history(local, remote) and restores(remote, "r", 2)
        assert {s.state for s in local.push_status().values()} == {
            "pushed"
        }  # the tier is remembered


def test_what_a_closed_process_left_unpushed_goes_with_the_next_push_to(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(uploader_mod, "CLOSE_ATTEMPTS", 1)
    monkeypatch.setattr(uploader_mod, "RETRY_SECONDS", (0.05,))
    real = uploader_mod.transfer

    def down(*a: Any, **k: Any) -> Any:
        raise OSError("remote down")

    monkeypatch.setattr(uploader_mod, "transfer", down)
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **KNOBS)
    fill(store, "r", [1, 2])
    with pytest.raises(errors.StorageError, match="remote 'tier'"):
        store.wait_pushed(timeout=30)
    store.close()  # gives up after CLOSE_ATTEMPTS failures: the snapshots stay local
    with ckstore.open(tmp_path / "local") as local:
        assert {s.state for s in local.push_status().values()} == {"pushing"}
        report = local.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == [] and report.snapshots_kept_unpushed == 1
    monkeypatch.setattr(uploader_mod, "transfer", real)
    with ckstore.open(tmp_path / "local", push_to="tier") as store:
        assert store.wait_pushed(timeout=60)
    with ckstore.open(tmp_path / "remote") as remote:
        assert restores(remote, "r@1", 1) and restores(remote, "r@2", 2)


def test_retention_and_gc_keep_what_the_remote_lacks(tmp_path, gate) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **KNOBS)
    try:
        fill(store, "r", [1, 2, 3, 4])
        report = store.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == [] and report.snapshots_kept_unpushed == 3
        assert store.check(read_data=True).ok and all(
            restores(store, f"r@{i}", i) for i in (1, 2, 3, 4)
        )
        gate.set()
        assert store.wait_pushed(timeout=60)
        report = store.gc(keep_last=1, grace_seconds=0)
        assert len(report.snapshots_dropped) == 3 and report.chunks_removed > 0
        assert store.check(read_data=True).ok and restores(store, "r", 4)
        with ckstore.open(tmp_path / "remote") as remote:
            assert (
                all(restores(remote, f"r@{i}", i) for i in (1, 2, 3, 4))
                and remote.check(read_data=True).ok
            )
    finally:
        store.close()


def _local_pack_bytes(store: ckstore.Store) -> int:
    return sum(size for _, size, _ in store.repository.index.local_packs_by_use())


def test_a_local_budget_evicts_pushed_packs_and_restores_fetch_them_verified(tmp_path) -> None:
    remote_dir = tmp_path / "remote"
    budget = 5 * KNOBS["pack_bytes"]
    store = ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(remote_dir),
        local_budget=budget,
        auto_compact=False,
        **KNOBS,
    )
    try:
        fill(store, "r", range(1, 9))
        assert store.wait_pushed(timeout=60)
        ev = store.last_eviction  # the last pass (wait_pushed may run one more, with nothing to do)
        assert (
            ev is not None and ev.local_bytes_after <= budget and _local_pack_bytes(store) <= budget
        ), ev
        evicted = store.repository.index.remote_pack_ids()
        assert evicted and set(evicted.values()) == {
            "tier"
        }  # rows of evicted chunks point at the remote
        assert all(
            restores(store, f"r@{i}", i) for i in range(1, 9)
        )  # what was evicted comes from the remote
        assert store.check(read_data=True).ok
        newest = store.repository.index.snapshot_chunk_ids(store.get("r@8").id)
        held_here = {
            c.chunk_id
            for c in store.repository.index.all_chunks()
            if c.pack_id in {p for p, _, _ in store.repository.index.local_packs_by_use()}
        }
        assert newest & held_here  # the newest state's packs were used last: they stay
    finally:
        store.close()
    with ckstore.open(
        tmp_path / "local"
    ) as plain:  # opened without push_to: reads still reach the remote
        assert restores(plain, "r@1", 1)
    # a damaged chunk at the remote is found when a restore fetches it, and named
    with ckstore.open(tmp_path / "local") as plain:
        remote_packs = plain.repository.index.remote_pack_ids()
        rows = [c for c in plain.repository.index.all_chunks() if c.pack_id in remote_packs]
        first = plain.repository.index.snapshot_chunk_ids(plain.get("r@1").id)
        victim = next(c for c in rows if c.chunk_id in first and c.depth == 0)
    pack = remote_dir / objects.pack_name(victim.pack_id)
    data = bytearray(pack.read_bytes())
    data[victim.offset] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    with ckstore.open(tmp_path / "local") as plain:
        with pytest.raises(errors.CorruptionError, match=victim.chunk_id[:12]):
            restores(plain, "r@1", 1)


def test_a_lost_local_tier_restores_bit_for_bit_from_the_remote(tmp_path) -> None:
    with ckstore.open(
        tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **KNOBS
    ) as store:
        fill(store, "r", [1, 2, 3], tags={2: ["best"]})
        assert store.wait_pushed(timeout=60)
        want = sorted((s.id, s.run, s.step) for s in store.log())
    shutil.rmtree(tmp_path / "local")  # the node is gone
    with ckstore.clone(tmp_path / "remote", tmp_path / "new") as again:
        assert sorted((s.id, s.run, s.step) for s in again.log()) == want
        assert all(restores(again, f"r@{i}", i) for i in (1, 2, 3)) and restores(again, "best", 2)
        assert again.check(read_data=True).ok


@pytest.mark.s3
def test_the_tier_on_s3_with_a_budget(tmp_path, s3_server) -> None:
    import uuid

    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/tier"
    opts = s3_server.storage_options()
    remote_index = f"sqlite:///{tmp_path / 'remote.sqlite'}"
    with ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=url,
        remote_index=remote_index,
        remote_options=opts,
        local_budget=4 * KNOBS["pack_bytes"],
        auto_compact=False,
        **KNOBS,
    ) as store:
        fill(store, "r", range(1, 6))
        assert store.wait_pushed(timeout=120)
        assert (
            store.repository.index.remote_pack_ids()
            and _local_pack_bytes(store) <= 4 * KNOBS["pack_bytes"]
        )
        assert all(restores(store, f"r@{i}", i) for i in range(1, 6))
    shutil.rmtree(tmp_path / "local")
    with ckstore.clone(url, tmp_path / "again", index=remote_index, storage_options=opts) as again:
        assert (
            all(restores(again, f"r@{i}", i) for i in range(1, 6))
            and again.check(read_data=True).ok
        )


def test_hydrate_brings_evicted_chunks_back_and_the_remote_can_go(tmp_path) -> None:
    fill_evicted(tmp_path / "local", tmp_path / "remote")
    with ckstore.open(
        tmp_path / "local"
    ) as store:  # without local_budget: nothing is evicted again
        with pytest.raises(errors.ConflictError, match="live only at remote 'tier'"):
            store.remove_remote("tier")
        report = store.hydrate()
        assert (
            report.chunks > 0
            and report.packs > 0
            and store.repository.index.remote_pack_ids() == {}
        )
        store.remove_remote("tier")
    shutil.rmtree(tmp_path / "remote")  # this store reads nothing from there any more
    with ckstore.open(tmp_path / "local") as store:
        assert (
            all(restores(store, f"r@{i}", i) for i in range(1, 7))
            and store.check(read_data=True).ok
        )
        assert store.remotes() == []


def test_takes_with_background_compaction_and_the_uploader_beside_them(tmp_path) -> None:
    """The defaults users get: auto_compact rewrites older snapshots densely while the uploader
    pushes them; a chunk moved under the push is sent from its new place."""
    with ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(tmp_path / "remote"),
        auto_compact=True,
        **KNOBS,
    ) as store:
        fill(store, "r", range(1, 13))
        assert store.wait_pushed(timeout=120)
        assert store.wait_compacted(timeout=120)
        assert store.check(read_data=True).ok
    with ckstore.open(tmp_path / "remote") as remote, ckstore.open(tmp_path / "local") as local:
        assert same_history(local, remote) and remote.check(read_data=True).ok
        assert all(restores(remote, f"r@{i}", i) for i in range(1, 13))


def _tier_child(local: str, remote: str, kill_at: int) -> None:
    from ckstore.remote import config
    from tests.support.push_kills import DEST_INDEX_CALLS, Arm, instrument

    arm = Arm(kill_at, "after")
    real = config.open_or_create

    def open_or_create(index: Any, record: Any, like: Any) -> Any:
        repo, created = real(index, record, like)
        instrument(repo, arm, DEST_INDEX_CALLS)
        return repo, created

    config.open_or_create = open_or_create  # type: ignore[assignment]
    store = ckstore.open(local, push_to=remote)
    fill(store, "r", [4, 5, 6])
    store.wait_pushed(timeout=60)
    os._exit(3)  # the kill point was never reached


def test_a_training_process_killed_while_its_uploader_pushes(tmp_path) -> None:
    import multiprocessing

    with ckstore.open(
        tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **KNOBS
    ) as store:
        fill(store, "r", [1, 2, 3])
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(
        target=_tier_child, args=(str(tmp_path / "local"), str(tmp_path / "remote"), 6)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9
    with ckstore.open(tmp_path / "remote") as remote:
        assert remote.check(read_data=True).ok
        assert all(restores(remote, s.id, s.step) for s in remote.log())  # nothing partial there
    with ckstore.open(
        tmp_path / "local", push_to="tier"
    ) as store:  # the next process pushes the rest
        assert {s.step for s in store.log()} == set(range(1, 7))
        assert store.wait_pushed(timeout=60)
    with ckstore.open(tmp_path / "remote") as remote, ckstore.open(tmp_path / "local") as local:
        assert (
            same_history(local, remote)
            and remote.check(read_data=True).ok
            and local.check(read_data=True).ok
        )


def test_a_gc_beside_a_hydrate_does_not_delete_the_packs_it_brings_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hydrate writes each pack it brings back from the tier remote, then records it. A gc of
    another handle (a cron's) that sweeps orphans in between sees the hydrate's write session
    alive and deletes nothing; before, it deleted the new pack, the hydrate pointed the chunks
    at it and dropped the remote's rows, and the snapshots were lost once the remote went."""
    with ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(tmp_path / "remote"),
        local_budget=4 * KNOBS["pack_bytes"],
        auto_compact=False,
        **KNOBS,
    ) as store:
        fill(store, "r", range(1, 7))
        assert store.wait_pushed(timeout=60) and store.repository.index.remote_pack_ids()
    other = ckstore.open(tmp_path / "local", auto_compact=False)
    swept = sweep_at_first_switch(monkeypatch, other)
    with ckstore.open(tmp_path / "local") as store:
        assert store.hydrate().packs > 0
    monkeypatch.undo()
    other.close()
    assert swept[0].orphans_removed == 0
    with ckstore.open(tmp_path / "local") as store:
        store.remove_remote("tier")
    shutil.rmtree(tmp_path / "remote")
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in range(1, 7))
        assert store.check(read_data=True).ok
