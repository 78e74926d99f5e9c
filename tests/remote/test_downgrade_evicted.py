"""A downgrade of the index below revision 0006 while chunks are evicted to the store's tier is
refused, and the index stays as it was. Before, the downgrade dropped ``packs.remote`` without a
word: the evicted chunks' rows then named local packs the store lacks, and after an upgrade
back those snapshots could not be restored (their bytes sat at the remote, unrecorded)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

import ckstore
from ckstore.index.db import make_engine
from ckstore.index.schema import upgrade
from tests.support.downgrades import downgrade, refused_downgrade, revision_of
from tests.support.remotes import fill_evicted, restores


def test_a_downgrade_that_would_forget_evicted_chunks_is_refused(tmp_path: Path) -> None:
    url = fill_evicted(tmp_path / "local", tmp_path / "remote")
    refused_downgrade(url, "0005", match="evicted")
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            assert "remote" in [r[1] for r in c.execute(sa.text("PRAGMA table_info(packs)"))]
    finally:
        engine.dispose()
    upgrade(url)
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in range(1, 7))
        report = store.hydrate()  # what the message says to do: then the downgrade runs
        assert report.chunks > 0 and store.repository.index.remote_pack_ids() == {}
    downgrade(url, "0005")
    assert revision_of(url) == "0005"
    upgrade(url)
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in range(1, 7))
