"""What a restore that cannot heal everything says: a committed snapshot whose damaged local
chunks no tier holds fails with ``CorruptionError`` (a deleted pack too: damage, not a remote
that went away), naming the snapshot and the previous healthy one; and the chunks it healed on
the way are counted in a ``HealedWarning`` all the same."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import ckstore
from tests.support.damage import flip, pack_path
from tests.support.remotes import KNOBS, fill, restores

OPTS = {**KNOBS, "auto_compact": False}


def _packs_of(store: ckstore.Store, ref: str) -> list[str]:
    repo = store.repository
    ids = repo.index.snapshot_chunk_ids(store.get(ref).id)
    return sorted({r.pack_id for r in repo.index.chunk_locations(ids).values()})


def test_a_deleted_local_pack_no_tier_holds_is_a_corruption_error(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "local", create=True, **OPTS)
    try:
        fill(store, "r", [1, 2])
        pack_path(tmp_path / "local", _packs_of(store, "r@2")[-1]).unlink()
        with pytest.raises(ckstore.CorruptionError, match=r"Snapshot r@2 .*any tier.*r@1"):
            restores(store, "r@2", 2)
    finally:
        store.close()


def test_chunks_healed_by_a_restore_that_still_fails_are_counted(tmp_path: Path) -> None:
    """r@1's packs are pushed; r@2 (taken after) is not. A pack of each deleted: the restore of
    r@2 heals r@1's pack's chunks it shares from the remote, fails on its own, and says both."""
    local = tmp_path / "local"
    store = ckstore.open(local, create=True, **OPTS)
    try:
        fill(store, "r", [1])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        fill(store, "r", [2])
        repo = store.repository
        shared = _packs_of(store, "r@1")
        mine = sorted(set(_packs_of(store, "r@2")) - set(shared))
        both = sorted(set(shared) & set(_packs_of(store, "r@2")))
        assert both and mine  # "slow" is the same at steps 1 and 2: a pack the two share
        needed = repo.index.snapshot_chunk_ids(store.get("r@2").id)
        held = {r.chunk_id for r in repo.index.all_chunks() if r.pack_id == both[0]} & needed
        pack_path(local, both[0]).unlink()
        pack_path(local, mine[0]).unlink()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ckstore.CorruptionError, match=r"Snapshot r@2 .*any tier.*r@1"):
                restores(store, "r@2", 2)
        healed = [str(w.message) for w in seen if issubclass(w.category, ckstore.HealedWarning)]
        assert healed and f"{len(held)} damaged chunk(s) healed" in " ".join(healed), healed
        assert all("r@2" in h and "backup" in h for h in healed), healed
        with pytest.warns(ckstore.HealedWarning, match="r@1"):  # the rest of r@1's pack
            assert restores(store, "r@1", 1)
    finally:
        store.close()


def test_a_delta_whose_damaged_base_heals_restores_though_no_remote_holds_the_delta(
    tmp_path: Path,
) -> None:
    """r@2 is stored as deltas on r@1 and never pushed; a base in r@1 (pushed) is damaged. The
    delta reads back sound once its base is healed: the restore heals the base and goes on, it
    does not give r@2 up because the remote lacks the delta itself."""
    local = tmp_path / "local"
    store = ckstore.open(local, create=True, **OPTS)
    try:
        fill(store, "r", [1])
        store.add_remote("backup", tmp_path / "backup")
        store.push("backup")
        fill(store, "r", [2], delta_base="parent")
        repo = store.repository
        ids = sorted(repo.index.snapshot_chunk_ids(store.get("r@2").id))
        rows = repo.index.chunk_locations(ids)
        bases = sorted({r.base_id for r in rows.values() if r.base_id is not None})
        assert bases  # "drift" changes a little each step: stored as deltas
        base = repo.index.chunk_locations(bases[:1])[bases[0]]
        flip(local, base)
        with pytest.warns(ckstore.HealedWarning, match=r"r@2.*backup"):
            assert restores(store, "r@2", 2)
        assert store.check(read_data=True).ok
    finally:
        store.close()
