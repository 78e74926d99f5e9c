"""Every index revision's frozen store (``fixture_stores``: made by the release that had that
revision) upgrades with today's code through ``ckstore migrate``, keeps every row it held, reads
back as that release read it, and restores bit for bit."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import StateDict, cli
from ckstore.errors import SchemaError
from ckstore.index.schema import HEAD_REVISION, MIGRATIONS_DIR

from .fixture_stores import COMMITS, expected, flat_digests, store_path

REVISIONS = sorted(COMMITS)

# What a column added after a store's revision holds in that store's old rows, where it is not
# NULL (docs/FORMAT.md, section 8; each revision's script says why).
ADDED_COLUMNS = {
    ("chunks", "depth"): 0,  # 0002: every old chunk is a full chunk
    ("packs", "loose"): 0,  # 0004: every old pack was written densely
}


def test_every_revision_has_its_frozen_store() -> None:
    scripts = {path.name[:4] for path in (MIGRATIONS_DIR / "versions").glob("[0-9]*.py")}
    assert set(REVISIONS) == scripts, "generate a frozen store per revision: see fixture_stores"
    assert REVISIONS[-1] == HEAD_REVISION
    for revision in REVISIONS:
        index = store_path(revision) / "index.sqlite"
        assert _rows(index)["alembic_version"] == {(revision,)}
        assert expected(revision)["revision"] == revision


@pytest.fixture(params=REVISIONS)
def frozen(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """(revision, a private copy of its frozen store)."""
    path = tmp_path / "store"
    shutil.copytree(store_path(request.param), path)
    return request.param, path


def test_migrate_keeps_every_row(frozen: tuple[str, Path], capsys: pytest.CaptureFixture) -> None:
    revision, path = frozen
    index = path / "index.sqlite"
    url = f"sqlite:///{index}"
    before, old_columns = _rows(index), _columns(index)
    if revision != HEAD_REVISION:  # never upgraded behind the user's back
        with pytest.raises(SchemaError, match=re.escape(f"ckstore migrate --index {url}")):
            ckstore.open(path)
    assert cli.main(["--store", str(path), "--json", "migrate"]) == 0
    assert json.loads(capsys.readouterr().out) == {"index": url, "revision": HEAD_REVISION}
    after, columns = _rows(index), _columns(index)
    assert after.pop("alembic_version") == {(HEAD_REVISION,)}
    del columns["alembic_version"]
    assert old_columns.keys() <= columns.keys() | {"alembic_version"}, "a table was dropped"
    for table, names in columns.items():
        old = old_columns.get(table, [])
        assert set(old) <= set(names), f"{table} lost columns"
        kept = [names.index(c) for c in old]
        added = [(names.index(c), ADDED_COLUMNS.get((table, c))) for c in names if c not in old]
        assert {tuple(row[i] for i in kept) for row in after[table]} == before.get(table, set())
        for row in after[table]:
            assert [row[i] for i, _ in added] == [value for _, value in added], (table, row)


def test_upgraded_store_reads_back_and_restores_bit_for_bit(frozen: tuple[str, Path]) -> None:
    revision, path = frozen
    assert cli.main(["--store", str(path), "migrate"]) == 0
    want = expected(revision)
    with ckstore.open(path) as store:
        assert store.runs() == want["runs"]
        assert store.tags() == want["tags"]
        assert [_fields(s) for s in store.log()] == want["snapshots"]
        if "remotes" in want:
            assert [_remote(r, revision) for r in store.remotes()] == want["remotes"]
        for snap_id, state in want["state"].items():
            app_state = _zeros_like(state)
            store.get(snap_id).restore(app_state)
            assert flat_digests(app_state) == state, snap_id
        report = store.check(read_data=True)
        assert report.ok, report.problems
        base, latest = store.get("sft-final"), store.get("sft").id  # and it takes new snapshots
        app_state = _zeros_like(want["state"][base.id])
        base.restore(app_state)
        app_state["model"]["counts"] += 1
        new = store.take(app_state, run="sft", step=1000, delta_base=base.id)
        again = _zeros_like(flat_digests(app_state))
        new.restore(again)
        assert flat_digests(again) == flat_digests(app_state)
        assert store.get("sft").parent_id == latest


def _rows(index: Path) -> dict[str, set[tuple[Any, ...]]]:
    """Every table's rows, as plain SQLite reads them."""
    conn = sqlite3.connect(index)
    try:
        return {t: set(conn.execute(f'SELECT * FROM "{t}"')) for t in _columns(index)}
    finally:
        conn.close()


def _columns(index: Path) -> dict[str, list[str]]:
    """Every table's columns, in order."""
    conn = sqlite3.connect(index)
    try:
        tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: [row[1] for row in conn.execute(f'PRAGMA table_info("{t}")')] for t in tables}
    finally:
        conn.close()


def _fields(snap: Any) -> dict[str, Any]:
    names = ("id", "run", "step", "name", "parent_id", "created_at", "metadata")
    return {name: getattr(snap, name) for name in names}


def _remote(record: Any, revision: str) -> dict[str, Any]:
    """The remote's fields as the release of ``revision`` read them (``store_id`` from 0007)."""
    names = ("name", "url", "index", "options", "tier")
    names += ("store_id",) if int(revision) >= 7 else ()
    return {name: getattr(record, name) for name in names}


def _zeros_like(state: dict[str, Any]) -> dict[str, StateDict]:
    """An app_state with the keys of ``state`` (as :func:`flat_digests` gives them): zeroed
    tensors of each dtype and shape, and None for every other value."""
    app_state: dict[str, StateDict] = {}
    for path, value in state.items():
        top, key = path.split("/", 1)
        if isinstance(value, dict) and "sha256" in value:
            dtype = getattr(torch, value["dtype"].removeprefix("torch."))
            value = torch.zeros(value["shape"], dtype=dtype)
        else:
            value = None
        app_state.setdefault(top, StateDict())[key] = value
    return app_state
