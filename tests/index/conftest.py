"""Fixtures of the index tests: every suite runs on SQLite and on a throwaway PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pgserver import PgServer


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def index_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of a fresh, empty index database: a SQLite file or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'index.sqlite'}"
    server: PgServer = request.getfixturevalue("pg")
    return server.new_database()
