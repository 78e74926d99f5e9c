"""The index can be rebuilt from the store alone (I5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckstore


def _history(store_path) -> list:
    store = ckstore.open(store_path, chunk_bytes=1024, pack_bytes=4096, create=True)
    st = ckstore.StateDict(w=torch.randn(64, 64), step=0)
    for i in range(4):
        st["w"][i] += 1
        st["step"] = i
        store.take(
            {"s": st},
            run="a" if i % 2 else "b",
            step=i,
            metadata={"i": i},
            name=f"n{i}" if i == 3 else None,
        )
    hist = [(s.id, s.run, s.step, s.parent_id, s.metadata, s.name) for s in store.log()]
    store.close()
    return hist


def _drop_index(store_path: Path) -> None:
    for f in store_path.iterdir():
        if f.name.startswith("index.sqlite"):
            f.unlink()


def test_reindex_rebuilds_history_from_packs_and_manifests(store_path):
    before = _history(store_path)
    _drop_index(store_path)
    store = ckstore.open(store_path, create=True)
    report = store.reindex()
    assert report.snapshots == 4 and report.skipped == []
    after = [(s.id, s.run, s.step, s.parent_id, s.metadata, s.name) for s in store.log()]
    assert after == before
    assert store.check(read_data=True).ok
    assert torch.equal(
        store.get("n3").read_object("s/w")[3], store.get("a@1").read_object("s/w")[3] + 1
    )
    with pytest.raises(ckstore.ConflictError, match="EMPTY"):
        store.reindex()


def test_reindex_skips_a_snapshot_whose_chunks_are_gone_and_cli_reports_it(store_path):
    _history(store_path)
    store = ckstore.open(store_path, create=True)
    victim = store.get("b@2")  # its take wrote only the chunk it alone needs
    other = set().union(*(s.manifest.chunk_ids() for s in store.log() if s.id != victim.id))
    lonely = victim.manifest.chunk_ids() - other
    assert lonely
    packs = {store.repository.index.chunk_locations([c])[c].pack_id for c in lonely}
    store.close()
    _drop_index(store_path)
    for p in packs:  # lose the packs only that snapshot needed
        ckstore.open(store_path, create=True).repository.objects.delete_pack(p)
    out = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(store_path), "reindex", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert (
        report["snapshots"] == 3
        and len(report["skipped"]) == 1
        and victim.id in report["skipped"][0]
    )


def _two_rank_take(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64)
    w = distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(1)], src_data_rank=None)
    store = ckstore.open(path, chunk_bytes=1024, pack_bytes=4096, create=True)
    snap = store.take({"s": ckstore.StateDict(w=w, rank=rank)}, run="d", step=5, metadata={"k": 1})
    store.close()
    return snap.id


def test_reindex_restores_world_size_and_the_figures_of_a_distributed_take(store_path, tmp_path):
    from tests.support.ranks import run_ranks, values

    ids = values(run_ranks(_two_rank_take, 2, tmp_path, str(store_path)))
    assert ids[0] == ids[1]
    with ckstore.open(store_path, create=True) as store:
        store.take({"s": ckstore.StateDict(w=torch.ones(300))}, run="d", step=6)
        before = {s.id: s.record for s in store.log()}
    assert before[ids[0]].world_size == 2 and before[ids[0]].new_bytes > 0
    _drop_index(store_path)
    with ckstore.open(store_path, create=True) as store:
        assert store.reindex().snapshots == 2
        after = {s.id: s.record for s in store.log()}
        assert (
            after[ids[0]] == before[ids[0]]
        )  # world_size and each rank's figures, from the header
        plain = next(i for i in after if i != ids[0])
        assert (
            after[plain].world_size == 1 and after[plain].new_bytes == after[plain].new_chunks == 0
        )
        assert store.get("d@5").read_object("s/rank") == [0, 1]


def test_reindex_skips_a_manifest_whose_header_world_size_is_malformed(store_path):
    from ckstore.format.manifest import Manifest

    _history(store_path)
    with ckstore.open(store_path, create=True) as store:
        good = store.get("n3").manifest
        for bad in ("two", 0, True):
            header = {**(good.snapshot or {}), "world_size": bad, "created_at": 1.0, "name": None}
            store.repository.objects.put_blob(
                "manifests", Manifest(good.apps, good.entries, header).to_json()
            )
    _drop_index(store_path)
    with ckstore.open(store_path, create=True) as store:
        report = store.reindex()
    assert report.snapshots == 4 and len(report.skipped) == 3
    assert all("world_size" in s for s in report.skipped)


def test_a_pack_reindex_cannot_read_for_now_stops_it_and_a_second_run_recovers_everything(
    tmp_path, monkeypatch
) -> None:
    """A transient storage failure (an S3 503 past its retries, a timeout) reading one pack's
    trailer stops the reindex, where it was skipped before: left out of the index, the pack
    and the manifests that needed it were deleted as orphans by the next routine gc."""
    import importlib

    from ckstore.errors import StorageError
    from tests.support.remotes import KNOBS, fill, restores

    reindex_module = importlib.import_module("ckstore.history.reindex")
    path = tmp_path / "store"
    store = ckstore.open(path, create=True, **KNOBS)
    fill(store, "r", [1, 2, 3])
    store.close()
    for f in path.iterdir():  # the index is lost: rebuild it (docs/RELIABILITY.md, I5)
        if f.name.startswith("index.sqlite"):
            f.unlink()
    real = reindex_module.objects.read_pack_index
    failed: list[str] = []

    def flaky(backend, pack_id):
        if not failed:
            failed.append(pack_id)
            raise StorageError(f"pack {pack_id}: 503 SlowDown (retries exhausted)")
        return real(backend, pack_id)

    monkeypatch.setattr(reindex_module.objects, "read_pack_index", flaky)
    with ckstore.open(path, create=True) as store:
        with pytest.raises(StorageError, match=r"reindex stopped: pack .* run `ckstore reindex`"):
            store.reindex()
        assert store.log() == []
        monkeypatch.setattr(reindex_module.objects, "read_pack_index", real)
        report = store.reindex()  # the storage answers again
        assert report.snapshots == 3 and report.skipped == [], report
        store.gc()
        assert all(restores(store, f"r@{s}", s) for s in (1, 2, 3))
        assert store.check(read_data=True).ok
