"""A damaged local copy heals from the other tier: a restore that finds a chunk damaged on disk
fetches it from a remote that holds it, verified against its id, writes it back into a new
local pack and goes on, bit-exact; without such a remote it names the snapshot and offers the
previous healthy one; ``Store.repair`` and ``ckstore repair`` heal a whole store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.format.manifest import TensorEntry
from tests.support.damage import flip
from tests.support.gc_beside import sweep_at_first_switch
from tests.support.remotes import KNOBS, fill, restores, state_for

OPTS = {**KNOBS, "auto_compact": False}


def _damage(store: ckstore.Store, root: Path, ref: str, n: int = 1) -> list[str]:
    """Flip a byte in the middle of the payloads of ``n`` local chunks ``ref`` uses; their ids."""
    repo = store.repository
    ids = sorted(repo.index.snapshot_chunk_ids(store.get(ref).id))
    rows = repo.index.chunk_locations(ids)
    hit = []
    for cid in ids:
        rec = rows[cid]
        if rec.base_id is not None or rec.length < 8:
            continue
        flip(root, rec)
        hit.append(cid)
        if len(hit) == n:
            break
    assert len(hit) == n
    return hit


def test_a_restore_heals_damaged_local_chunks_from_the_tier_remote(tmp_path: Path) -> None:
    local = tmp_path / "local"
    store = ckstore.open(local, create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1, 2])
        assert store.wait_pushed(timeout=60)
        hit = _damage(store, local, "r@2", n=2)
        assert not store.check(read_data=True).ok
        with pytest.warns(ckstore.HealedWarning, match=r"r@2.*2 damaged chunk\(s\) healed.*tier"):
            assert restores(store, "r@2", 2)
        report = store.check(read_data=True)
        assert report.ok, report.problems
        rows = store.repository.index.chunk_locations(hit)
        assert all(rows[c].base_id is None for c in hit)
        assert restores(store, "r@2", 2) and restores(store, "r@1", 1)
    finally:
        store.close()


def test_without_a_remote_the_damage_names_the_snapshot_and_the_previous_healthy_one(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1, 2, 3])
        _damage(store, tmp_path / "local", "r@3")
        with pytest.raises(ckstore.CorruptionError, match=r"r@3.*any tier.*r@2"):
            restores(store, "r@3", 3)
    finally:
        store.close()


def test_a_remote_whose_copy_is_damaged_too_heals_nothing(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1])
        assert store.wait_pushed(timeout=60)
        with ckstore.open(tmp_path / "remote") as remote:
            hit = _damage(remote, tmp_path / "remote", "r@1")
        repo = store.repository
        flip(tmp_path / "local", repo.index.chunk_locations(hit)[hit[0]])  # damaged here too
        with pytest.raises(ckstore.CorruptionError, match="any tier"):
            restores(store, "r@1", 1)
    finally:
        store.close()


def test_store_repair_heals_every_damaged_chunk_from_a_named_remote(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1, 2])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        hit = _damage(store, tmp_path / "local", "r@1") + _damage(store, tmp_path / "local", "r@2")
        report = store.repair("backup")
        assert set(report.healed) == set(hit) and report.ok, report.to_dict()
        assert set(report.healed.values()) == {"backup"}
        assert store.check(read_data=True).ok
        assert restores(store, "r@1", 1) and restores(store, "r@2", 2)
    finally:
        store.close()


def _cli(store: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(store), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ckstore_repair_end_to_end(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    fill(store, "r", [1])
    store.add_remote("backup", tmp_path / "backup")
    store.push("backup")
    hit = _damage(store, tmp_path / "local", "r@1")
    store.close()
    out = _cli(tmp_path / "local", "repair", "--from", "backup", "--json")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["healed"] == {hit[0]: "backup"} and found["ok"] is True
    out = _cli(tmp_path / "local", "repair", "--json")  # nothing left to heal
    assert out.returncode == 0 and json.loads(out.stdout)["healed"] == {}
    with ckstore.open(tmp_path / "local") as again:
        assert again.check(read_data=True).ok and restores(again, "r@1", 1)


def test_ckstore_repair_exits_non_zero_when_damage_stays(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    fill(store, "r", [1])
    hit = _damage(store, tmp_path / "local", "r@1")
    store.close()
    out = _cli(tmp_path / "local", "repair")
    assert out.returncode != 0
    assert hit[0][:16] in out.stdout + out.stderr


def test_a_pull_of_a_snapshot_whose_local_chunks_are_damaged_sends_them_again(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1, 2])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        hit = _damage(store, tmp_path / "local", "r@2")
        report = store.pull("backup", ["r@2"])
        assert report.chunks_healed == hit and report.stats.chunks_sent == 1
        assert store.check(read_data=True).ok and restores(store, "r@2", 2)
        assert store.pull("backup", ["r@2"]).stats.chunks_sent == 0  # sound now: nothing to send
    finally:
        store.close()


def test_check_read_data_repair_heals_as_repair_does(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    fill(store, "r", [1])
    assert store.wait_pushed(timeout=60)
    hit = _damage(store, tmp_path / "local", "r@1")
    store.close()
    assert _cli(tmp_path / "local", "check", "--read-data").returncode != 0
    out = _cli(tmp_path / "local", "check", "--read-data", "--repair", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["healed"] == {hit[0]: "tier"}
    assert _cli(tmp_path / "local", "check", "--read-data").returncode == 0


@pytest.mark.parametrize("harm", ["truncate", "delete"])
def test_a_restore_heals_a_truncated_or_deleted_local_pack(tmp_path: Path, harm: str) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1])
        assert store.wait_pushed(timeout=60)
        repo = store.repository
        ids = repo.index.snapshot_chunk_ids(store.get("r@1").id)
        pack_id = sorted({r.pack_id for r in repo.index.chunk_locations(ids).values()})[0]
        path = (tmp_path / "local").joinpath(*objects.pack_name(pack_id).split("/"))
        if harm == "delete":
            path.unlink()
        else:
            os.chmod(path, 0o644)
            os.truncate(path, path.stat().st_size // 2)
        with pytest.warns(ckstore.HealedWarning, match="tier"):
            assert restores(store, "r@1", 1)
        assert restores(store, "r@1", 1)
    finally:
        store.close()


@pytest.mark.parametrize("atomic", [True, False])
def test_the_restore_heals_in_its_own_pass_without_running_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    import ckstore._heal_verbs as heal_verbs

    def again(*args: object) -> None:
        raise AssertionError("the restore ran again instead of healing as it read")

    monkeypatch.setattr(heal_verbs, "heal_restore", again)
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1, 2])
        assert store.wait_pushed(timeout=60)
        hit = _damage(store, tmp_path / "local", "r@2", n=3)
        want = state_for(2)
        out = {"m": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
        with pytest.warns(ckstore.HealedWarning, match=r"3 damaged chunk\(s\)") as seen:
            store.get("r@2").restore(out, atomic=atomic)
        assert len([w for w in seen if issubclass(w.category, ckstore.HealedWarning)]) == 1
        assert all(torch.equal(out["m"][k], v) for k, v in want.items())
        assert all(h[:16] in str(seen[0].message) for h in hit)
        assert store.check(read_data=True).ok
    finally:
        store.close()


def test_a_damaged_base_of_deltas_heals_and_its_deltas_read_again(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1, 2, 3, 4])
        assert store.wait_pushed(timeout=60)
        store.compact(keep_loose=0)
        repo = store.repository
        rows = {c.chunk_id: c for c in repo.index.all_chunks()}
        bases = {r.base_id for r in rows.values() if r.base_id is not None}
        assert bases, "compaction stored no delta"
        flip(tmp_path / "local", rows[sorted(bases)[0]])
        with pytest.warns(ckstore.HealedWarning):
            assert all([restores(store, f"r@{i}", i) for i in (1, 2, 3, 4)])
        assert store.check(read_data=True).ok
    finally:
        store.close()


def _restore_on_rank(rank: int, world: int, path: str) -> bool:
    import warnings

    warnings.simplefilter("ignore", ckstore.HealedWarning)
    want = state_for(2)
    out = {"m": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
    with ckstore.open(path) as store:
        store.get("r@2").restore(out)
    return all(torch.equal(out["m"][k], v) for k, v in want.items())


def test_a_distributed_restore_heals_on_the_rank_that_reads_the_chunk(tmp_path: Path) -> None:
    from tests.support.ranks import run_ranks, values

    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    fill(store, "r", [1, 2])
    assert store.wait_pushed(timeout=60)
    _damage(store, tmp_path / "local", "r@2", n=3)
    store.close()
    assert values(run_ranks(_restore_on_rank, 2, tmp_path, str(tmp_path / "local"))) == [True] * 2
    with ckstore.open(tmp_path / "local") as again:
        assert again.check(read_data=True).ok


def test_a_read_only_store_names_the_damage_and_how_to_heal_it(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    fill(store, "r", [1, 2])
    assert store.wait_pushed(timeout=60)
    _damage(store, tmp_path / "local", "r@2")
    store.close()
    with ckstore.open(tmp_path / "local", read_only=True) as ro:
        with pytest.raises(ckstore.CorruptionError, match=r"r@2.*read-only.*ckstore repair.*r@1"):
            restores(ro, "r@2", 2)


def _read_all(store: ckstore.Store, how: str, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of app ``m`` of ``r@2``, read through the read path ``how``."""
    snap = store.get("r@2")
    if how == "read_object":
        return dict(snap.read_object("m"))
    if how == "torchsnapshot_read_object":
        return dict(ckstore.Snapshot.of(snap).read_object("0/m"))
    if how == "get_state_dict_for_key":
        return dict(snap.get_state_dict_for_key("m"))
    if how == "read_regions":  # the DCP reader's path: regions of entries it lays out itself
        entries = {
            k: e
            for k, e in snap.manifest.entries.items()
            if k.startswith("m/") and isinstance(e, TensorEntry)
        }
        regions = {k: ((0,) * len(e.shape), tuple(e.shape)) for k, e in entries.items()}
        got = snap.read_regions(entries, regions)
        return {k.removeprefix("m/"): v for k, v in got.items()}
    snap.export(out, "torch")
    (saved,) = out.glob("*.pt")
    return dict(torch.load(saved, weights_only=True)["m"])


@pytest.mark.parametrize(
    "how",
    [
        "read_object",
        "torchsnapshot_read_object",
        "get_state_dict_for_key",
        "read_regions",
        "export",
    ],
)
def test_every_read_path_heals_as_a_restore_does(tmp_path: Path, how: str) -> None:
    store = ckstore.open(tmp_path / "local", create=True, push_to=str(tmp_path / "remote"), **OPTS)
    try:
        fill(store, "r", [1, 2])
        assert store.wait_pushed(timeout=60)
        hit = _damage(store, tmp_path / "local", "r@2", n=2)
        with pytest.warns(ckstore.HealedWarning, match=r"r@2.*2 damaged chunk\(s\) healed") as seen:
            got = _read_all(store, how, tmp_path / "out")
        assert len([w for w in seen if issubclass(w.category, ckstore.HealedWarning)]) == 1
        assert all(h[:16] in str(seen[0].message) for h in hit)
        want = state_for(2)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
        assert store.check(read_data=True).ok
    finally:
        store.close()


def test_a_restore_that_heals_chunk_by_chunk_opens_each_remote_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.remote import config

    opened: list[str] = []
    real = config.open_remote

    def counting(*args: Any, **kw: Any) -> Any:
        opened.append(args[1].name)
        return real(*args, **kw)

    monkeypatch.setattr(config, "open_remote", counting)
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1, 2])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        opened.clear()
        _damage(store, tmp_path / "local", "r@2", n=3)
        with pytest.warns(ckstore.HealedWarning, match=r"3 damaged chunk\(s\)"):
            assert restores(store, "r@2", 2)
        _damage(store, tmp_path / "local", "r@1", n=1)
        with pytest.warns(ckstore.HealedWarning):
            assert restores(store, "r@1", 1)
        report = store.repair()
        assert report.ok and opened == ["backup"]  # kept open for the store handle's life
    finally:
        store.close()


def test_a_remote_that_cannot_be_opened_is_tried_once_per_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.remote import config

    tries: list[str] = []

    def down(*args: Any, **kw: Any) -> Any:
        tries.append(args[1].name)
        raise ckstore.StorageError("the share is not mounted")

    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        _damage(store, tmp_path / "local", "r@1", n=3)
        monkeypatch.setattr(config, "open_remote", down)
        with pytest.raises(ckstore.CorruptionError):
            store.get("r@1").read_object("m")
        assert tries == ["backup"]
    finally:
        store.close()


def test_chunks_found_damaged_during_a_heal_are_healed_together_in_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    import ckstore._heal_verbs as heal_verbs
    import ckstore.remote.heal as remote_heal  # what the healer calls (imported on use)

    calls: list[list[str]] = []
    release = threading.Event()
    real = remote_heal.heal

    def gated(repo: Any, chunk_ids: Any, *args: Any, **kw: Any) -> Any:
        calls.append(list(chunk_ids))
        if len(calls) == 1:
            assert release.wait(30)
        return real(repo, chunk_ids, *args, **kw)

    monkeypatch.setattr(remote_heal, "heal", gated)
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        a, b, c = _damage(store, tmp_path / "local", "r@1", n=3)
        # no room to hold healed bytes: every heal is written before the read goes on
        healer = heal_verbs.RestoreHealer(store.get("r@1").view, budget=0)
        results: dict[str, Any] = {}

        def ask(cid: str) -> None:
            results[cid] = healer(cid)

        first = threading.Thread(target=ask, args=(a,))
        first.start()
        while not calls:
            time.sleep(0.01)
        others = [threading.Thread(target=ask, args=(cid,)) for cid in (b, c)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while len(healer._queued) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for t in [first, *others]:
            t.join(30)
        assert results == {a: True, b: True, c: True}
        assert calls == [[a], sorted([b, c])]  # the two that waited: one heal, one new pack
        assert store.check(read_data=True).ok
    finally:
        store.close()


def test_the_remotes_healing_opened_close_with_the_store(tmp_path: Path) -> None:
    from ckstore.remote import readers

    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    fill(store, "r", [1])
    store.add_remote("backup", tmp_path / "backup")
    store.push("backup")
    _damage(store, tmp_path / "local", "r@1")
    repo = store.repository
    with pytest.warns(ckstore.HealedWarning):
        assert restores(store, "r@1", 1)
    there = readers.readers_of(repo).get(repo.index.get_remote("backup"))  # type: ignore[arg-type]
    assert there.read_only and not there.closed
    store.close()
    assert there.closed and repo not in readers._READERS


def test_a_gc_beside_a_repair_does_not_delete_the_pack_it_heals_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repair writes the chunks it fetched into a new local pack, then records it. A gc of
    another handle that sweeps orphans in between sees the repair's write session alive and
    deletes nothing; before, it deleted the new pack and the repair pointed the healed chunks
    at it: damaged, they became missing."""
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    other = ckstore.open(tmp_path / "local", **OPTS)
    try:
        fill(store, "r", [1, 2])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        hit = _damage(store, tmp_path / "local", "r@2")
        swept = sweep_at_first_switch(monkeypatch, other)
        report = store.repair("backup")
        monkeypatch.undo()
        assert set(report.healed) == set(hit) and report.ok, report.to_dict()
        assert swept[0].orphans_removed == 0
        assert store.check(read_data=True).ok
        assert restores(store, "r@1", 1) and restores(store, "r@2", 2)
    finally:
        other.close()
        store.close()
