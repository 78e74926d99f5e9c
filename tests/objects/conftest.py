"""Fixtures for the object layer: a session moto server and a backend per implementation."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckstore.objects import Backend, LocalBackend, open_backend

try:
    from _s3server import S3Server
except ImportError:  # tests/ not on sys.path under this import mode
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from _s3server import S3Server


@pytest.fixture
def s3_backend(s3_server: S3Server) -> Iterator[Backend]:
    """An S3 backend on a fresh bucket and prefix."""
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(bucket)
    backend = open_backend(f"s3://{bucket}/p-{uuid.uuid4().hex[:8]}", s3_server.storage_options())
    yield backend
    backend.close()


@pytest.fixture(params=["memory", "local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend implementation in turn, empty."""
    if request.param == "memory":
        b: Backend = open_backend("memory://")
    elif request.param == "local":
        b = LocalBackend(tmp_path / "store")
    else:
        b = request.getfixturevalue("s3_backend")
    yield b
    b.close()
