"""A downgrade of the index below revision 0006 while chunks are evicted to the store's tier is
refused, and the index stays as it was. Before, the downgrade dropped ``packs.remote`` without a
word: the evicted chunks' rows then named local packs the store lacks, and after an upgrade
back those snapshots could not be restored (their bytes sat at the remote, unrecorded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import alembic_config, upgrade
from tests.support.remotes import KNOBS, fill, restores


def test_a_downgrade_that_would_forget_evicted_chunks_is_refused(tmp_path: Path) -> None:
    from alembic import command

    with ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(tmp_path / "remote"),
        local_budget=4 * KNOBS["pack_bytes"],
        auto_compact=False,
        **KNOBS,
    ) as store:
        fill(store, "r", range(1, 7))
        assert store.wait_pushed(timeout=60) and store.repository.index.remote_pack_ids()
        url = store.index_url
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            before = c.scalar(sa.text("SELECT version_num FROM alembic_version"))
        with pytest.raises(RuntimeError, match="evicted"):
            command.downgrade(alembic_config(url=url), "0005")
        with engine.connect() as c:
            after = c.scalar(sa.text("SELECT version_num FROM alembic_version"))
            cols = [r[1] for r in c.execute(sa.text("PRAGMA table_info(packs)"))]
        assert after == before, f"a refused downgrade left the index at {after} (was {before})"
        assert "remote" in cols, cols
    finally:
        engine.dispose()
    upgrade(url)
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in range(1, 7))
        report = store.hydrate()  # what the message says to do: then the downgrade runs
        assert report.chunks > 0 and store.repository.index.remote_pack_ids() == {}
    engine = make_engine(url)
    try:
        command.downgrade(alembic_config(url=url), "0005")
        with engine.connect() as c:
            assert c.scalar(sa.text("SELECT version_num FROM alembic_version")) == "0005"
    finally:
        engine.dispose()
    upgrade(url)
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in range(1, 7))
