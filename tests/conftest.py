"""Shared fixtures: real servers on loopback (PostgreSQL, S3), and stores with tiny knobs so
small tensors take the multi-chunk, multi-pack paths."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

import ckstore
from tests.support.pgserver import PgServer, PgServerError, pg_server
from tests.support.s3server import S3Server, start_or_skip
from tests.support.seaweed import SeaweedServer
from tests.support.seaweed import start_or_skip as start_seaweed_or_skip

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}

# Background compaction after takes would rewrite packs while tests inspect them: off unless a
# test turns it on (tests/history/test_compact.py does). Child processes inherit it.
os.environ.setdefault("CKSTORE_AUTO_COMPACT", "0")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server on 127.0.0.1 for the whole session (fails under CI if it cannot start)."""
    server = start_or_skip()
    try:
        yield server
    finally:
        server.reset()
        server.stop()


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server (a real one, on disk) on 127.0.0.1 for the whole session.

    Fails under CI if it cannot start. Share a bucket between tests (fresh prefix per test):
    every SeaweedFS bucket takes a volume of its own, and their number is bounded.
    """
    server = start_seaweed_or_skip()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _pg_state() -> Iterator[dict[str, object]]:
    with ExitStack() as stack:
        try:
            server = stack.enter_context(pg_server())
        except PgServerError as exc:
            yield {"error": str(exc)}
            return
        yield {"server": server}


@pytest.fixture
def pg(_pg_state: dict[str, object]) -> PgServer:
    """The session's throwaway PostgreSQL; skipped here (failed under CI) if it cannot start."""
    if "server" not in _pg_state:
        reason = f"PostgreSQL unavailable: {_pg_state.get('error')}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return _pg_state["server"]  # type: ignore[return-value]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[ckstore.Store]:
    s = ckstore.open(store_path, **TINY, create=True)
    yield s
    s.close()


@pytest.fixture(params=["local+sqlite", "memory+sqlite", "s3+postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    """The same store suite on every backend/index pairing users deploy."""
    if request.param == "local+sqlite":
        s = ckstore.open(tmp_path / "store", **TINY, create=True)
    elif request.param == "memory+sqlite":
        s = ckstore.open(f"memory://store-{uuid.uuid4().hex}", **TINY, create=True)
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        pgs: PgServer = request.getfixturevalue("pg")
        bucket = f"ck-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        s = ckstore.open(
            f"s3://{bucket}/ckpts",
            index=pgs.new_database(),
            storage_options=server.storage_options(),
            **TINY,
            create=True,
        )
    yield s
    s.close()
