"""Downgrades of the index that would make an unhealthy snapshot pass for healthy, or forget
which one is healthy, are refused, and the index stays as it was. Before:

- below revision 0008, a snapshot whose replicas diverged lost ``snapshots.diverged``: after
  an upgrade back it passed for healthy, so ``run@healthy`` named it and ``gc``'s "newest
  healthy" kept it and deleted the snapshot a rollback needs;
- below revision 0005, ``snapshots.nonfinite`` and ``stale`` went: after an upgrade back no
  snapshot was known healthy, ``run@healthy`` named none, and ``gc(keep_last=1)`` deleted the
  healthy snapshot before a NaN one."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
import torch

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import upgrade
from tests.conftest import TINY
from tests.support.downgrades import refused_downgrade


def _app(value: float) -> dict[str, ckstore.StateDict]:
    return {"m": ckstore.StateDict({"w": torch.full((8,), value)})}


def _still_healthy(store_path: Path, url: str, good: str, bad: str) -> None:
    """After an upgrade: ``r@healthy`` is ``good``, and gc keeps it beside the newer ``bad``."""
    upgrade(url)
    with ckstore.open(store_path) as store:
        assert store.get("r@healthy").id == good
        store.gc(keep_last=1)  # keeps the newest and the newest healthy
        assert {s.id for s in store.log(run="r")} == {good, bad}


def test_a_downgrade_that_would_make_a_diverged_snapshot_healthy_is_refused(
    tmp_path: Path,
) -> None:
    with ckstore.open(tmp_path / "store", create=True, **TINY) as store:
        good, bad = (store.take(_app(float(s)), run="r", step=s).id for s in (0, 1))
        url = store.index_url
    engine = make_engine(url)
    try:
        # what a distributed take records when the ranks' replicas of a tensor disagree
        with engine.begin() as c:
            c.execute(sa.text("UPDATE snapshots SET diverged = 1 WHERE id = :id"), {"id": bad})
    finally:
        engine.dispose()
    refused_downgrade(url, "0007", match="diverged")
    _still_healthy(tmp_path / "store", url, good, bad)


def test_a_downgrade_that_would_forget_which_snapshot_is_healthy_is_refused(
    tmp_path: Path,
) -> None:
    with ckstore.open(tmp_path / "store", create=True, **TINY) as store:
        good = store.take(_app(1.0), run="r", step=0).id
        bad = store.take(_app(float("nan")), run="r", step=1, on_nonfinite="ignore").id
        assert store.get("r@healthy").id == good
        url = store.index_url
    refused_downgrade(url, "0004", match="NaN")
    _still_healthy(tmp_path / "store", url, good, bad)
