"""Whole stores on S3 servers: take, restore, gc and check through ``ckstore.open("s3://...", create=True)``
on moto and on SeaweedFS (a real server writing to disk), with a SQLite index."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore

pytestmark = pytest.mark.s3

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
SERVERS = {"moto": "s3_server", "seaweedfs": "seaweed_server"}


@pytest.fixture(params=sorted(SERVERS))
def s3(request: pytest.FixtureRequest) -> Any:
    """Each S3 server in turn."""
    return request.getfixturevalue(SERVERS[request.param])


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(32, 24, generator=gen) for i in range(3)}


def _restore(store: ckstore.Store, ref: str, want: dict[str, torch.Tensor]) -> None:
    dest = ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})
    store.get(ref).restore({"m": dest})
    assert all(torch.equal(dest[k], v) for k, v in want.items()), ref


def test_take_restore_and_gc_round_trip(s3: Any, tmp_path: Path) -> None:
    # One bucket per test: SeaweedFS volumes are per bucket, but two tests need only two.
    bucket = f"stores-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(bucket)
    url = f"s3://{bucket}/ckpts"
    index = f"sqlite:///{tmp_path / 'index.db'}"
    options = s3.storage_options()
    first, second = _state(1), _state(1)
    second["w0"] = second["w0"] + 1  # only w0 changes: the second take dedups the rest

    with ckstore.open(url, index=index, storage_options=options, **TINY, create=True) as store:
        store.take({"m": ckstore.StateDict(first)}, run="r", step=1)
        store.take({"m": ckstore.StateDict(second)}, run="r", step=2)

    with ckstore.open(url, index=index, storage_options=options, create=False) as store:
        _restore(store, "r@1", first)
        _restore(store, "r@2", second)
        report = store.check(read_data=True)
        assert report.ok, report.problems
        assert report.snapshots == 2 and not report.orphan_packs

        # Dropping r@1 leaves its old w0 unreferenced: gc deletes (or repacks) it on the server.
        before = set(store.repository.objects.backend.list())
        store.delete("r@1")
        gc = store.gc(grace_seconds=0)
        assert gc.chunks_removed > 0 and gc.manifests_removed == 1, gc
        assert len(before - set(store.repository.objects.backend.list())) >= 1
        _restore(store, "r@2", second)
        report = store.check(read_data=True)
        assert report.ok, report.problems
        assert report.snapshots == 1 and not report.orphan_packs
