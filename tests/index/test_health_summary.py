"""Revisions 0005 and 0008: each snapshot's health summary (``nonfinite``, ``stale`` and
``diverged``) in the index.

``log(healthy=True)`` and the ref ``run@healthy`` filter on it without reading a manifest: a
healthy snapshot holds no NaN or Inf, no stale tensor and no replicas that disagree; snapshots
without a record (older ones) are unknown, never unhealthy.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from sqlalchemy import text

from ckstore.errors import InvalidInputError, SchemaError, SnapshotNotFoundError
from ckstore.index import Index, make_engine, upgrade
from ckstore.index.schema import HEAD_REVISION
from tests.support.downgrades import refused_downgrade

from . import fixture_data_0003 as frozen
from .helpers import add_chunks, snapshot


def _commit(
    ix: Index,
    run: str,
    step: int,
    nonfinite: int | None,
    stale: int | None = None,
    diverged: int | None = None,
) -> str:
    session = ix.begin_session("test", 60)
    ids = add_chunks(ix, session.id, f"pack-{run}-{step}", [f"{run}{step}"])
    rec = dataclasses.replace(
        snapshot(run, step), nonfinite=nonfinite, stale=stale, diverged=diverged
    )
    return ix.commit_snapshot(session.id, rec, [], ids, 10, ()).id


def test_summary_round_trips_and_filters(index_url: str) -> None:
    with Index.open(index_url) as ix:
        old = _commit(ix, "r", 1, None)  # recorded no health: unknown
        good = _commit(ix, "r", 2, 0, stale=0)
        _commit(ix, "r", 3, 17, stale=2)  # diverged
        assert ix.get_snapshot(good).healthy is True and ix.get_snapshot(old).healthy is None
        bad = ix.resolve("r@3")
        assert (bad.nonfinite, bad.stale, bad.healthy) == (17, 2, False)
        assert [s.step for s in ix.list_snapshots("r", healthy=True)] == [2]
        assert [s.step for s in ix.list_snapshots(healthy=True)] == [2]
        assert ix.resolve("r@healthy").id == good
        _commit(ix, "r", 4, 0)
        assert ix.resolve("r@healthy").step == 4


def test_healthy_skips_stale_and_diverged_snapshots(index_url: str) -> None:
    """A run whose optimizer stopped stepping, then whose replicas drifted apart: ``r@healthy``
    rolls back past both to the last snapshot that trained and agreed."""
    with Index.open(index_url) as ix:
        good = _commit(ix, "r", 1, 0, stale=0, diverged=0)
        _commit(ix, "r", 2, 0, stale=3)  # finite, but the optimizer did not step
        _commit(ix, "r", 3, 0, stale=0, diverged=1)  # one rank's copy differs
        assert ix.resolve("r@healthy").id == good
        assert [s.step for s in ix.list_snapshots("r", healthy=True)] == [1]
        healthy = {s.step: s.healthy for s in ix.list_snapshots("r")}
        assert healthy == {1: True, 2: False, 3: False}
        got = ix.resolve("r@3")
        assert (got.nonfinite, got.stale, got.diverged) == (0, 0, 1)
        _commit(ix, "r", 4, 0)  # nothing compared (no parent step, one process): healthy
        assert ix.resolve("r@healthy").step == 4


def test_healthy_ref_names_why_nothing_matches(index_url: str) -> None:
    with Index.open(index_url) as ix:
        _commit(ix, "old", 1, None)
        _commit(ix, "bad", 1, 3)
        with pytest.raises(SnapshotNotFoundError, match="none of its snapshots recorded health"):
            ix.resolve("old@healthy")
        _commit(ix, "stuck", 1, 0, stale=2)
        for ref in ("bad@healthy", "stuck@healthy"):
            with pytest.raises(
                SnapshotNotFoundError,
                match="every snapshot it recorded health for holds NaN or Inf, is stale",
            ):
                ix.resolve(ref)
        with pytest.raises(InvalidInputError, match="after '@' comes a step number"):
            ix.resolve("old@healty")  # a typo is still a bad step, not a name


def test_frozen_revision_0003_upgrades_with_unknown_health(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    shutil.copyfile(frozen.FILE, path)
    url = f"sqlite:///{path}"
    with pytest.raises(SchemaError, match=f"ckstore migrate --index {url}"):
        Index.open(url, create=False)
    assert upgrade(url) == HEAD_REVISION  # through 0004 (loose packs), 0005 (health) and later
    with Index.open(url, create=False) as ix:
        snaps = ix.list_snapshots("sft")
        assert [(s.step, s.nonfinite, s.stale, s.healthy) for s in snaps] == [
            (200, None, None, None),
            (100, None, None, None),
        ]
        assert ix.list_snapshots("sft", healthy=True) == []
        assert {c.chunk_id: (c.base_id, c.depth, c.payload_digest) for c in ix.all_chunks()} == {
            cid: (row[5], row[6], row[7]) for cid, row in frozen.CHUNKS.items()
        }
        assert ix.resolve("best").step == 200
        _commit(ix, "sft", 300, 0)  # new takes record health beside the old rows
        assert ix.resolve("sft@healthy").step == 300


def test_0005_migrates_down_and_up_in_place(index_url: str) -> None:
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        _commit(ix, "r", 1, 0, stale=0)  # healthy: NaN or stale ones refuse it (below)
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0004")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT * FROM snapshots")).mappings().one()
            assert "nonfinite" not in row and "stale" not in row and row["step"] == 1
    finally:
        engine.dispose()
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        got = ix.resolve("r@1")
        assert (got.nonfinite, got.stale) == (None, None)  # the summary is gone: unknown again


def test_0008_migrates_down_and_up_in_place(index_url: str) -> None:
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        _commit(ix, "r", 1, 0, stale=0, diverged=0)  # diverged ones refuse it (below)
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0007")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT * FROM snapshots")).mappings().one()
            assert "diverged" not in row and (row["nonfinite"], row["stale"]) == (0, 0)
    finally:
        engine.dispose()
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        got = ix.resolve("r@1")
        assert (got.nonfinite, got.stale, got.diverged, got.healthy) == (0, 0, None, True)


@pytest.mark.parametrize(
    ("revision", "figures", "match"),
    [
        ("0004", (5, 0, None), "NaN"),
        ("0004", (0, 1, None), "stale"),
        ("0007", (0, 0, 2), "diverged"),
    ],
)
def test_a_downgrade_that_would_lose_an_unhealthy_record_is_refused(
    index_url: str, revision: str, figures: tuple[int, int, int | None], match: str
) -> None:
    """Below 0005 no snapshot is known healthy any more, below 0008 a diverged one passes for
    healthy: with such a record, the downgrade is refused (tests/index/test_downgrade_health.py
    has what gc did after one)."""
    with Index.open(index_url) as ix:
        _commit(ix, "r", 1, *figures)
    refused_downgrade(index_url, revision, match)
