"""Helpers of the migration tests: an index downgraded as alembic's CLI runs it, and a
downgrade that must be refused leaving the index at its revision."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config


def revision_of(url: str) -> str:
    """The index's revision (``alembic_version``)."""
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return str(c.scalar(sa.text("SELECT version_num FROM alembic_version")))
    finally:
        engine.dispose()


def downgrade(url: str, revision: str) -> None:
    """Downgrade the index at ``url`` to ``revision`` as ``alembic downgrade`` does."""
    from alembic import command

    command.downgrade(alembic_config(url=url), revision)


def refused_downgrade(url: str, revision: str, match: str) -> None:
    """Assert that downgrading to ``revision`` raises a RuntimeError matching ``match`` and
    leaves the index at the revision it had."""
    before = revision_of(url)
    with pytest.raises(RuntimeError, match=match):
        downgrade(url, revision)
    after = revision_of(url)
    assert after == before, f"a refused downgrade left the index at {after} (was {before})"
