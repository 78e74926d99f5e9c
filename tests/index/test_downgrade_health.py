"""A downgrade of the index below revision 0005 while a snapshot records NaN/Inf (or stale
tensors) is refused, and the index stays as it was. Before, it dropped ``snapshots.nonfinite``
and ``stale``: after an upgrade back no snapshot was known healthy, so ``run@healthy`` named
nothing and ``gc``'s "newest healthy" no longer kept the snapshot before a diverged run's NaN
one: ``gc(keep_last=1)`` deleted it."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config, upgrade
from tests.conftest import TINY


def test_a_downgrade_that_would_forget_which_snapshot_is_healthy_is_refused(
    tmp_path: Path,
) -> None:
    from alembic import command

    with ckstore.open(tmp_path / "store", create=True, **TINY) as store:
        ok = {"m": ckstore.StateDict({"w": torch.ones(8)})}
        nan = {"m": ckstore.StateDict({"w": torch.full((8,), float("nan"))})}
        good = store.take(ok, run="r", step=0).id
        bad = store.take(nan, run="r", step=1, on_nonfinite="ignore").id
        assert store.get("r@healthy").id == good
        url = store.index_url
    engine = make_engine(url)
    try:
        with pytest.raises(RuntimeError, match="NaN"):
            command.downgrade(alembic_config(url=url), "0004")
        with engine.connect() as c:
            assert c.scalar(sa.text("SELECT version_num FROM alembic_version")) == "0008"
    finally:
        engine.dispose()
    upgrade(url)
    with ckstore.open(tmp_path / "store") as store:
        assert store.get("r@healthy").id == good
        store.gc(keep_last=1)  # keeps the newest and the newest healthy
        assert {s.id for s in store.log(run="r")} == {good, bad}
