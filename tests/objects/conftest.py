"""Fixtures for the object layer: session S3 servers (moto and SeaweedFS) and a backend per
implementation."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckstore.objects import Backend, LocalBackend, S3Backend, open_backend

S3_SERVERS = {"moto": "s3_server", "seaweedfs": "seaweed_server"}
"""S3 server kind -> the session fixture that runs it."""


@pytest.fixture(scope="session")
def _s3_clients() -> dict[str, tuple[str, Any]]:
    """Per S3 server kind: one bucket and one s3fs instance, made on first use, shared by
    the session (a new s3fs instance costs a new botocore session, about 0.5 s)."""
    return {}


def open_s3(request: pytest.FixtureRequest, kind: str) -> S3Backend:
    """An S3 backend on a fresh prefix of the ``kind`` server's session bucket.

    Tests share one bucket per server (SeaweedFS gives every bucket a volume of its own) and
    get a fresh prefix each, which isolates them just as well.
    """
    clients: dict[str, tuple[str, Any]] = request.getfixturevalue("_s3_clients")
    prefix = f"p-{uuid.uuid4().hex[:12]}"
    if kind in clients:
        bucket, fs = clients[kind]
        return S3Backend(fs, f"{bucket}/{prefix}")
    server = request.getfixturevalue(S3_SERVERS[kind])
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    server.create_bucket(bucket)
    backend = open_backend(f"s3://{bucket}/{prefix}", server.storage_options())
    assert isinstance(backend, S3Backend)
    clients[kind] = (bucket, backend.fs)
    return backend


@pytest.fixture(params=sorted(S3_SERVERS))
def s3_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """An S3 backend on a fresh prefix, on each S3 server in turn."""
    backend = open_s3(request, request.param)
    yield backend
    backend.close()


@pytest.fixture(params=["memory", "local", *(f"s3-{kind}" for kind in sorted(S3_SERVERS))])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend implementation in turn, empty (S3 once per server)."""
    if request.param == "memory":
        b: Backend = open_backend("memory://")
    elif request.param == "local":
        b = LocalBackend(tmp_path / "store")
    else:
        b = open_s3(request, request.param.removeprefix("s3-"))
    yield b
    b.close()
