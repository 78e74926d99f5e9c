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
    store = ckstore.open(store_path, chunk_bytes=1024, pack_bytes=4096)
    st = ckstore.StateDict(w=torch.randn(64, 64), step=0)
    for i in range(4):
        st["w"][i] += 1
        st["step"] = i
        store.take({"s": st}, run="a" if i % 2 else "b", step=i, metadata={"i": i}, name=f"n{i}" if i == 3 else None)
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
    store = ckstore.open(store_path)
    report = store.reindex()
    assert report.snapshots == 4 and report.skipped == []
    after = [(s.id, s.run, s.step, s.parent_id, s.metadata, s.name) for s in store.log()]
    assert after == before
    assert store.check(read_data=True).ok
    assert torch.equal(store.get("n3").read_object("s/w")[3], store.get("a@1").read_object("s/w")[3] + 1)
    with pytest.raises(ckstore.ConflictError, match="EMPTY"):
        store.reindex()


def test_reindex_skips_a_snapshot_whose_chunks_are_gone_and_cli_reports_it(store_path):
    _history(store_path)
    store = ckstore.open(store_path)
    victim = store.get("b@2")  # its take wrote only the chunk it alone needs
    other = set().union(*(s.manifest.chunk_ids() for s in store.log() if s.id != victim.id))
    lonely = victim.manifest.chunk_ids() - other
    assert lonely
    packs = {store.index.chunk_locations([c])[c].pack_id for c in lonely}
    store.close()
    _drop_index(store_path)
    for p in packs:  # lose the packs only that snapshot needed
        ckstore.open(store_path).objects.delete_pack(p)
    out = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(store_path), "reindex", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["snapshots"] == 3 and len(report["skipped"]) == 1 and victim.id in report["skipped"][0]
