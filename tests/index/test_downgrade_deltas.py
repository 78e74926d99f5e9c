"""A downgrade of the index below revision 0002 while deltas are stored is refused, and the
index stays as it was. Before, PostgreSQL dropped ``base_id``/``depth`` in place, and after an
upgrade back every compacted snapshot raised CorruptionError; and on SQLite, the downgrades
above 0002 ran and were kept before the refusal (every migration now runs in one
transaction), leaving the index at 0002 without the columns of 0003-0008."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config, upgrade
from tests.conftest import TINY
from tests.support.pgserver import PgServer


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, generator=g)
    w[seed * 10 : seed * 10 + 5] += 1.0  # a small change per step: compaction stores deltas
    return {"w": w}


@pytest.mark.postgres
def test_a_downgrade_that_would_drop_deltas_is_refused(tmp_path: Path, pg: PgServer) -> None:
    from alembic import command

    url = pg.new_database()
    store = ckstore.open(tmp_path / "store", index=url, create=True, **TINY)
    try:
        for step in range(3):
            store.take({"s": ckstore.StateDict(_state(step))}, run="r", step=step)
        store.compact(keep_loose=0)
        assert any(c.base_id is not None for c in store.repository.index.all_chunks())
    finally:
        store.close()

    engine = make_engine(url)
    refused = False
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0001")
    except RuntimeError as exc:
        refused = "deltas" in str(exc)
    finally:
        engine.dispose()
    upgrade(url)

    store = ckstore.open(tmp_path / "store", index=url, **TINY)
    try:
        for step in range(3):
            out = {"w": torch.zeros(3000)}
            store.get(f"r@{step}").restore({"s": ckstore.StateDict(out)})
            assert torch.equal(out["w"], _state(step)["w"]), (step, refused)
    finally:
        store.close()
    assert refused


def test_a_refused_downgrade_leaves_the_index_as_it_was(tmp_path: Path) -> None:
    from alembic import command

    store = ckstore.open(tmp_path / "store", create=True, **TINY)
    try:
        for step in range(3):
            store.take({"s": ckstore.StateDict(_state(step))}, run="r", step=step)
        store.compact(keep_loose=0)
        assert any(c.base_id is not None for c in store.repository.index.all_chunks())
        url = store.index_url
    finally:
        store.close()
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            before = c.scalar(sa.text("SELECT version_num FROM alembic_version"))
        refused = False
        try:
            command.downgrade(alembic_config(url=url), "0001")  # as alembic's CLI runs it
        except RuntimeError as exc:
            refused = "deltas" in str(exc)
        assert refused
        with engine.connect() as c:
            after = c.scalar(sa.text("SELECT version_num FROM alembic_version"))
            cols = [r[1] for r in c.execute(sa.text("PRAGMA table_info(packs)"))]
        assert after == before, f"a refused downgrade left the index at {after} (was {before})"
        assert "remote" in cols and "loose" in cols, cols
    finally:
        engine.dispose()
