"""A downgrade of the index below revision 0008 while a snapshot records replicas that
diverged is refused, and the index stays as it was. Before, it dropped ``snapshots.diverged``
without a word: after an upgrade back, the diverged snapshot passed for healthy, so
``run@healthy`` named it and retention's "newest healthy" kept it instead of the one a rollback
needs, deleting that one."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config, upgrade
from tests.conftest import TINY


def test_a_downgrade_that_would_make_a_diverged_snapshot_healthy_is_refused(
    tmp_path: Path,
) -> None:
    from alembic import command

    with ckstore.open(tmp_path / "store", create=True, **TINY) as store:
        for step in range(2):
            store.take(
                {"m": ckstore.StateDict({"w": torch.full((8,), float(step))})}, run="r", step=step
            )
        good, bad = (store.get(f"r@{s}").id for s in range(2))
        url = store.index_url
    engine = make_engine(url)
    try:
        # what a distributed take records when the ranks' replicas of a tensor disagree
        with engine.begin() as c:
            c.execute(sa.text("UPDATE snapshots SET diverged = 1 WHERE id = :id"), {"id": bad})
        with ckstore.open(tmp_path / "store") as store:
            assert store.get("r@healthy").id == good
        with pytest.raises(RuntimeError, match="diverged"):
            command.downgrade(alembic_config(url=url), "0007")
        with engine.connect() as c:
            assert c.scalar(sa.text("SELECT version_num FROM alembic_version")) == "0008"
    finally:
        engine.dispose()
    upgrade(url)
    with ckstore.open(tmp_path / "store") as store:
        assert store.get("r@healthy").id == good
        store.gc(keep_last=1)  # keeps the newest and the newest healthy
        assert {s.id for s in store.log(run="r")} == {good, bad}
