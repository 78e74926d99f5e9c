"""Fixtures of the index tests: every suite runs on SQLite and on a throwaway PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from _pgserver import PgServer, PgServerError, pg_server


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
    """The session's PostgreSQL server; skipped (failed under CI) if it could not start."""
    if "server" not in _pg_state:
        reason = f"PostgreSQL unavailable: {_pg_state.get('error')}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return _pg_state["server"]  # type: ignore[return-value]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def index_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of a fresh, empty index database: a SQLite file or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'index.sqlite'}"
    server: PgServer = request.getfixturevalue("pg")
    return server.new_database()
