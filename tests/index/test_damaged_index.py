"""A damaged SQLite index gives IndexCorruptionError naming the file and how to rebuild it.

Before, damage surfaced as whatever the driver raised: ``UnicodeDecodeError`` out of
``ckstore.open`` (SQLite's own error message about a damaged schema was not UTF-8), a generic
IndexError_, or ``json.JSONDecodeError`` from a row. The store's objects are intact, so the
advice in the message (move the index aside, ``ckstore reindex``) must bring everything back.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.errors import CorruptionError, IndexCorruptionError, IndexError_


def _make(path: Path) -> Path:
    s = ckstore.open(path, chunk_bytes=1024, pack_bytes=8192, create=True)
    s.take(
        {"m": ckstore.StateDict(w=torch.arange(900.0))}, run="runname", step=1, metadata={"a": 1}
    )
    s.close()
    db = path / "index.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db


def _patch_bytes(db: Path, find: bytes, replace: bytes, start: int = 0) -> None:
    data = bytearray(db.read_bytes())
    at = data.find(find, start)
    assert at >= 0, find
    while at >= 0:
        data[at : at + len(replace)] = replace
        at = data.find(find, at + 1)
    db.write_bytes(bytes(data))


def _sql(db: Path, statement: str) -> None:
    conn = sqlite3.connect(db)
    conn.execute(statement)
    conn.commit()
    conn.close()


def _assert_names_file_and_fix(exc: BaseException, db: Path) -> None:
    assert isinstance(exc, CorruptionError) and isinstance(exc, OSError)
    assert isinstance(exc, IndexError_)  # still an index failure for callers catching that
    assert str(db) in str(exc) and "reindex" in str(exc)


def test_damaged_schema_page_is_a_typed_error_from_open(tmp_path):
    db = _make(tmp_path / "s")
    _patch_bytes(db, b"CREATE TABLE sessions", b"CREAT\x9f")  # used to be UnicodeDecodeError
    with pytest.raises(IndexCorruptionError) as info:
        ckstore.open(tmp_path / "s", create=True)
    _assert_names_file_and_fix(info.value, db)


def test_header_that_is_not_sqlite_is_a_typed_error(tmp_path):
    db = _make(tmp_path / "s")
    data = bytearray(db.read_bytes())
    data[:16] = b"not a database!!"
    db.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptionError) as info:
        ckstore.open(tmp_path / "s", create=True)
    _assert_names_file_and_fix(info.value, db)


def test_text_that_is_not_utf8_in_a_row_is_a_typed_error(tmp_path):
    db = _make(tmp_path / "s")
    _patch_bytes(db, b"runname", b"\xff\xfe\xfd", start=4096)
    store = ckstore.open(tmp_path / "s", create=True)
    with pytest.raises(IndexCorruptionError) as info:
        store.log()
    _assert_names_file_and_fix(info.value, db)
    store.close()


@pytest.mark.parametrize(
    "statement, call",
    [
        ("UPDATE snapshots SET metadata = '{broken'", lambda s: s.log()),
        ("UPDATE snapshots SET metadata = '[1]'", lambda s: s.get("runname")),
        ("UPDATE manifest_entries SET shape = 'x'", lambda s: s.diff("runname", "runname")),
        ("UPDATE chunks SET \"offset\" = 'abc'", lambda s: s.get("runname").read_object("m/w")),
        ("UPDATE chunks SET length = -5", lambda s: s.check()),
    ],
)
def test_rows_that_do_not_decode_are_a_typed_error(tmp_path, statement, call):
    db = _make(tmp_path / "s")
    _sql(db, statement)
    store = ckstore.open(tmp_path / "s", create=True)
    with pytest.raises(IndexCorruptionError) as info:
        call(store)
    _assert_names_file_and_fix(info.value, db)
    store.close()


def test_following_the_advice_rebuilds_the_index(tmp_path, capsys):
    path = tmp_path / "s"
    db = _make(path)
    _patch_bytes(db, b"CREATE TABLE sessions", b"CREAT\x9f")
    with pytest.raises(IndexCorruptionError):
        ckstore.open(path, create=True)
    aside = tmp_path / "aside"
    aside.mkdir()
    for f in path.glob("index.sqlite*"):
        shutil.move(str(f), aside / f.name)
    assert cli.main(["--store", str(path), "reindex"]) == 0
    store = ckstore.open(path, create=True)
    (snap,) = store.log()
    assert (snap.run, snap.step, snap.metadata) == ("runname", 1, {"a": 1})
    assert torch.equal(snap.read_object("m/w"), torch.arange(900.0))
    assert store.check(read_data=True).ok
    store.close()
