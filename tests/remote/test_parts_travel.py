"""A distributed snapshot (its manifest stored in parts, docs/FORMAT.md 7.7) travels whole:
an export writes every tensor, push copies its parts and nodes like its chunks, the remote
restores it and checks clean, a clone carries it, and gc keeps the parts while the snapshot
lives and collects them after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)
from safetensors.torch import load_file

import ckstore
from ckstore.format import parts
from ckstore.format.verify import verify_path
from tests.distributed import scenarios as sc
from tests.support.ranks import run_ranks, values
from tests.support.states import bits

pytestmark = pytest.mark.timeout(300)


def _take(rank: int, world: int, path: str) -> str:
    with ckstore.open(path) as store:
        app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "l": sc.local_app(rank)}
        return store.take(app, run="dist", step=1, tags=["best"]).id


def _read_all(store: ckstore.Store, ref: str) -> dict[str, Any]:
    snap = store.get(ref)
    return {k: snap.read_object(k) for k in snap.manifest.entries}


def test_push_clone_and_gc_of_a_snapshot_in_parts(tmp_path: Path) -> None:
    src_path = tmp_path / "src"
    ckstore.open(src_path, **sc.TINY, create=True).close()
    (sid, _) = values(run_ranks(_take, 2, tmp_path, str(src_path)))
    with ckstore.open(src_path) as src:
        snap = src.get("best")
        ids = snap.manifest.referenced_ids()
        assert len(snap.manifest.parts) == 2 and src.repository.index.snapshot_chunk_ids(sid) == ids
        want = _read_all(src, "best")
        entries = snap.entries()
        assert any(e.digest.startswith(parts.DIGEST_PREFIX) for e in entries)
        exported = snap.export(tmp_path / "export", format="safetensors", keys=["g/*"])
        assert verify_path(str(tmp_path / "export")).ok
        tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
        assert exported.tensors == len(tensors) and tensors
        keyed = {k if k in want else f"g/{k}": t for k, t in tensors.items()}
        assert set(keyed) == {
            k for k, v in want.items() if k.startswith("g/") and torch.is_tensor(v)
        }
        assert [k for k, t in keyed.items() if not _same(t, want[k])] == []
        src.add_remote("origin", str(tmp_path / "remote"))
        report = src.push("origin")
        assert report.stats.chunks_sent == len(ids)  # the parts travel like chunks
    with ckstore.open(tmp_path / "remote") as remote:
        there = remote.get("best")
        assert there.id == sid and there.record.world_size == 2
        assert there.manifest.parts == snap.manifest.parts
        rows = {e.key: e for e in there.entries()}
        assert rows == {e.key: e for e in entries}  # the same rows, digests of parts' entries too
        got = _read_all(remote, "best")
        assert [k for k in want if not _same(got[k], want[k])] == []
        assert remote.check(read_data=True).ok
    with ckstore.clone(tmp_path / "remote", tmp_path / "clone") as clone:
        assert clone.get("best").manifest.entries == snap.manifest.entries
        assert clone.check(read_data=True).ok
    with ckstore.open(src_path) as src:
        src.gc(grace_seconds=0)  # the snapshot lives: its parts stay
        assert src.check(read_data=True).ok
        assert _same_all(_read_all(src, "best"), want)
        src.untag("best")
        src.delete(sid)
        gone = src.gc(grace_seconds=0)
        assert gone.manifests_removed == 1 and gone.chunks_removed >= len(ids)
        rows = src.repository.index.chunk_locations(ids)
        assert not rows  # parts and chunks collected with the snapshot
        assert src.check(read_data=True).ok


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "dtype"):  # bit for bit (the state holds NaN)
        return bool(a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b))
    return bool(a == b)


def _same_all(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
