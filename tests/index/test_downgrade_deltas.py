"""PostgreSQL: a downgrade of the index below revision 0002 while deltas are stored is refused,
and the deltas stay readable. Before, PostgreSQL dropped ``base_id``/``depth`` in place, and
after an upgrade back every compacted snapshot raised CorruptionError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config, upgrade
from tests.conftest import TINY
from tests.support.pgserver import PgServer

pytestmark = pytest.mark.postgres


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, generator=g)
    w[seed * 10 : seed * 10 + 5] += 1.0  # a small change per step: compaction stores deltas
    return {"w": w}


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
