"""Fixtures of the remote tests: a source store with history, and destinations of every kind."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.support.remotes import KNOBS, fill


@pytest.fixture
def source(tmp_path: Path) -> Iterator[ckstore.Store]:
    """A local store with three snapshots of run ``r`` (tag ``best`` at step 2) and one of run ``s``."""
    store = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(store, "r", [1, 2, 3], tags={2: ["best"]})
    fill(store, "s", [10])
    yield store
    store.close()


@pytest.fixture(
    params=[
        "local+sqlite",
        pytest.param("s3+postgresql", marks=[pytest.mark.s3, pytest.mark.postgres]),
        pytest.param("seaweedfs+sqlite", marks=pytest.mark.s3),
    ]
)
def remote_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Where a remote lives: a folder, moto S3 with a PostgreSQL index, or SeaweedFS with an
    SQLite index file: ``{"url", "index", "storage_options"}`` for ``add_remote``."""
    if request.param == "local+sqlite":
        return {"url": str(tmp_path / "remote"), "index": None, "storage_options": None}
    if request.param == "s3+postgresql":
        server = request.getfixturevalue("s3_server")
        bucket = f"ck-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        return {
            "url": f"s3://{bucket}/remote",
            "index": request.getfixturevalue("pg").new_database(),
            "storage_options": server.remote_options(),
        }
    server = request.getfixturevalue("seaweed_server")
    # a remote's credentials come from the environment; SeaweedFS refuses a session token
    request.getfixturevalue("monkeypatch").delenv("AWS_SESSION_TOKEN", raising=False)
    bucket = "ckremote"
    if bucket not in server.buckets():
        server.create_bucket(bucket)
    return {
        "url": f"s3://{bucket}/{uuid.uuid4().hex[:12]}",
        "index": f"sqlite:///{tmp_path / 'remote.sqlite'}",
        "storage_options": server.remote_options(),
    }


@pytest.fixture
def open_remote(remote_spec: dict[str, Any]) -> Iterator[Callable[[], ckstore.Store]]:
    """Opens the remote store itself (after a push made it)."""
    opened: list[ckstore.Store] = []

    def opener() -> ckstore.Store:
        s = ckstore.open(
            remote_spec["url"],
            index=remote_spec["index"],
            storage_options=remote_spec["storage_options"],
        )
        opened.append(s)
        return s

    yield opener
    for s in opened:
        s.close()
