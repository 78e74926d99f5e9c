"""A resume from S3, counted at the server: four ranks restore a distributed snapshot from
SeaweedFS through a counting proxy. The store is never listed (the index says what exists), the
root of the manifest is fetched once in the job and each of its parts at most once, and every
chunk's bytes are fetched once."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from tests.distributed import scenarios as sc
from tests.support.faultproxy import FaultProxy
from tests.support.ranks import run_ranks, values
from tests.support.s3server import storage_options

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]


def _take(rank: int, world: int, url: str, index: str, options: dict[str, Any]) -> str:
    with ckstore.open(url, index=index, storage_options=options) as store:
        app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "l": sc.local_app(rank)}
        return store.take(app, run="job", step=1).id


def _resume(rank: int, world: int, url: str, index: str, options: dict[str, Any]) -> None:
    with ckstore.open(url, index=index, storage_options=options) as store:
        dest = ckstore.StateDict(sc.dtensors(world, False, True))  # other placements
        local = ckstore.StateDict(
            {
                k: torch.zeros_like(v) if torch.is_tensor(v) else -1
                for k, v in sc.local_app(rank).items()
            }
        )
        store.get("job@1").restore({"g": dest, "l": local})
        sc.check_global(dest)
        sc.check_local(local, rank)


def test_a_resume_lists_nothing_and_fetches_each_object_once(
    seaweed_server: Any, tmp_path: Path
) -> None:
    bucket = f"resume-{uuid.uuid4().hex[:12]}"
    seaweed_server.create_bucket(bucket)
    url = f"s3://{bucket}/ckpts"
    index = f"sqlite:///{tmp_path / 'index.db'}"
    with FaultProxy(seaweed_server.endpoint_url) as proxy:
        options = storage_options(proxy.url)
        ckstore.open(url, index=index, storage_options=options, **sc.TINY, create=True).close()
        (sid, *_) = values(run_ranks(_take, 4, tmp_path, url, index, options))
        with ckstore.open(url, index=index, storage_options=options) as store:
            snap = store.get("job@1")
            parts, data = set(snap.manifest.parts), snap.manifest.chunk_ids()
            rows = store.repository.index.chunk_locations(parts | data)
        proxy.events.clear()
        values(run_ranks(_resume, 4, tmp_path, url, index, options))
        events = list(proxy.events)
    assert snap.id == sid and len(parts) == 4
    lists = [e for e in events if e.method == "GET" and _is_listing(e.target, bucket)]
    gets = Counter((e.target.split("?")[0], e.range) for e in events if e.method == "GET")
    print(f"{len(events)} requests: {Counter(e.method for e in events)}, {len(lists)} LIST")
    assert not lists
    roots = {k: n for k, n in gets.items() if "/manifests/" in k[0]}
    assert list(roots.values()) == [1], roots  # the root: once in the job (rank 0)
    ranges = {
        (
            f"/{bucket}/ckpts/packs/{r.pack_id[:2]}/{r.pack_id}.pack",
            f"bytes={r.offset}-{r.offset + r.length - 1}",
        ): cid
        for cid, r in rows.items()
    }
    fetched = Counter(ranges[k] for k, n in gets.items() for _ in range(n) if k in ranges)
    assert set(fetched) <= parts | data
    assert all(n == 1 for n in fetched.values()), [c for c, n in fetched.items() if n > 1]
    assert parts & set(fetched) and data <= set(fetched)  # every chunk came from the server once


def _is_listing(target: str, bucket: str) -> bool:
    """A GET that lists: ListObjects (v1 or v2) on the bucket, with or without a prefix."""
    path, _, query = target.partition("?")
    return path.rstrip("/") == f"/{bucket}" or any(
        q.split("=")[0] in ("list-type", "prefix", "delimiter") for q in query.split("&")
    )


def test_listings_are_recognised() -> None:
    assert _is_listing("/b?list-type=2&prefix=ckpts%2Fpacks%2F", "b")
    assert _is_listing("/b/?prefix=ckpts&delimiter=%2F", "b")  # ListObjects v1
    assert _is_listing("/b", "b")
    assert not _is_listing("/b/ckpts/packs/ab/ab12.pack", "b")
    assert not _is_listing("/b/ckpts/manifests/ab/ab12?x-id=GetObject", "b")
