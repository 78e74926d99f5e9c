"""Revisions 0006 and 0007: remotes (and the id of the store each is), what each holds, and chunk
rows pointed at a remote's packs (SQLite and PostgreSQL); the frozen revision-0003 database
upgrades through them with its data intact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import text

from ckstore.errors import ConflictError, InvalidInputError, NotFoundError, SchemaError
from ckstore.index import ChunkRecord, Index, PackRecord, RemoteRecord, upgrade
from ckstore.index.db import make_engine
from ckstore.index.schema import HEAD_REVISION

from . import fixture_data_0003 as frozen
from .helpers import ENTRIES, add_chunks, cid, snapshot


def _commit(ix: Index, run: str, labels: list[str], pack: str) -> str:
    session = ix.begin_session("test", 60).id
    ids = add_chunks(ix, session, pack, labels)
    return ix.commit_snapshot(session, snapshot(run, len(labels)), ENTRIES, ids, 10).id


def test_remotes_are_named_kept_and_removed(index_url: str) -> None:
    with Index.open(index_url) as ix:
        ix.add_remote(RemoteRecord("origin", "/srv/ckpts", options={"anon": True}))
        ix.add_remote(RemoteRecord("tier", "s3://b/p", index="postgresql://u@h/db"))
        assert [(r.name, r.url, r.index, r.options, r.tier) for r in ix.list_remotes()] == [
            ("origin", "/srv/ckpts", None, {"anon": True}, False),
            ("tier", "s3://b/p", "postgresql://u@h/db", {}, False),
        ]
        with pytest.raises(ConflictError, match="/srv/ckpts"):
            ix.add_remote(RemoteRecord("origin", "/elsewhere"))
        with pytest.raises(InvalidInputError, match="remote name"):
            ix.add_remote(RemoteRecord("a@b", "/x"))
        ix.set_remote_tier("tier", True)
        assert ix.get_remote("tier").tier  # type: ignore[union-attr]
        ix.remove_remote("origin")
        assert ix.get_remote("origin") is None
        with pytest.raises(NotFoundError):
            ix.remove_remote("origin")


def test_what_a_tier_lacks_is_what_retention_keeps(index_url: str) -> None:
    with Index.open(index_url) as ix:
        a, b = _commit(ix, "r", ["a"], "p1" * 32), _commit(ix, "r", ["b"], "p2" * 32)
        ix.add_remote(RemoteRecord("origin", "/x"))
        assert ix.unpushed_to_tiers() == set()  # no tier: nothing waits
        ix.set_remote_tier("origin", True)
        assert ix.unpushed_to_tiers() == {a, b} and [s.id for s in ix.unpushed("origin")] == [a, b]
        ix.mark_pushed("origin", [a])
        ix.mark_pushed("origin", [a])  # idempotent
        assert ix.unpushed_to_tiers() == {b} and ix.remote_holdings() == {a: {"origin"}}
        assert ix.pushed_chunk_ids("origin", [cid("a"), cid("b")]) == {cid("a")}


def test_rows_point_at_a_remote_with_exact_depths_and_never_under_a_writer(index_url: str) -> None:
    with Index.open(index_url) as ix:
        ix.add_remote(RemoteRecord("tier", "/t"))
        s = ix.begin_session("w", 60).id
        base, delta, other = cid("base"), cid("delta"), cid("other")
        ix.add_pack(
            s,
            PackRecord("aa" * 32, 100, 2),
            [
                ChunkRecord(base, "aa" * 32, 32, 10, 64, "zstd"),
                ChunkRecord(other, "aa" * 32, 42, 10, 64, "zstd"),
            ],
        )
        ix.add_pack(
            s,
            PackRecord("bb" * 32, 100, 1),
            [ChunkRecord(delta, "bb" * 32, 32, 5, 64, "xor-zstd", base, 1)],
        )
        ix.end_session(s, "committed")
        # the remote holds `base` as a delta against a chunk this store never had: both rows come
        root = cid("root")
        there = [
            ChunkRecord(root, "cc" * 32, 32, 9, 64, "zstd"),
            ChunkRecord(base, "cc" * 32, 41, 4, 64, "xor-zstd", root, 1),
        ]
        assert ix.point_chunks_at_remote("tier", there, {base: "aa" * 32}) == [base]
        rows = ix.chunk_locations([delta])
        assert (rows[base].pack_id, rows[base].depth, rows[delta].depth, rows[root].depth) == (
            "cc" * 32,
            1,
            2,
            0,
        )
        assert ix.remote_pack_ids() == {"cc" * 32: "tier"}
        # a compare-and-swap: a row no longer where the caller saw it stays
        assert (
            ix.point_chunks_at_remote(
                "tier", [ChunkRecord(other, "dd" * 32, 0, 10, 64, "zstd")], {other: "bb" * 32}
            )
            == []
        )
        # a chunk a live writer pinned keeps its row (the writer may be storing a delta against it)
        w = ix.begin_session("writer", 60).id
        ix.lookup_chunks(w, [other])
        assert (
            ix.point_chunks_at_remote(
                "tier", [ChunkRecord(other, "dd" * 32, 0, 10, 64, "zstd")], {other: "aa" * 32}
            )
            == []
        )
        ix.end_session(w, "aborted")
        assert ix.point_chunks_at_remote(
            "tier", [ChunkRecord(other, "dd" * 32, 0, 10, 64, "zstd")], {other: "aa" * 32}
        ) == [other]
        assert [p for p, _, _ in ix.local_packs_by_use()] == ["aa" * 32, "bb" * 32]
        ix.touch_packs({"aa" * 32: 9e12})
        assert [p for p, _, _ in ix.local_packs_by_use()] == [
            "bb" * 32,
            "aa" * 32,
        ]  # least recently used first
        with pytest.raises(ConflictError, match="live only at remote 'tier'"):
            ix.remove_remote("tier")


def test_frozen_revision_0003_upgrades_through_0006_and_0007(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    shutil.copyfile(frozen.FILE, path)
    url = f"sqlite:///{path}"
    with pytest.raises(SchemaError, match="ckstore migrate"):
        Index.open(url, create=False)
    assert upgrade(url) == HEAD_REVISION
    with Index.open(url, create=False) as ix:
        assert {c.chunk_id: (c.pack_id, c.base_id, c.depth) for c in ix.all_chunks()} == {
            k: (v[0], v[5], v[6]) for k, v in frozen.CHUNKS.items()
        }
        assert ix.list_remotes() == [] and ix.remote_pack_ids() == {}
        assert [s.id for s in ix.list_snapshots("sft")] == [
            frozen.SNAPSHOTS[1][0],
            frozen.SNAPSHOTS[0][0],
        ]
        ix.add_remote(RemoteRecord("origin", "/x", tier=True, store_id="ab" * 16))
        assert ix.unpushed_to_tiers() == {s[0] for s in frozen.SNAPSHOTS}
        assert ix.get_remote("origin").store_id == "ab" * 16  # type: ignore[union-attr]


def test_0006_migrates_down_and_up_in_place(index_url: str) -> None:
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        a = _commit(ix, "r", ["a"], "p1" * 32)
        ix.add_remote(RemoteRecord("origin", "/x"))
        ix.mark_pushed("origin", [a])
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0005")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT * FROM packs")).mappings().first()
            assert row is not None and "remote" not in row and "used_at" not in row
    finally:
        engine.dispose()
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        assert ix.list_remotes() == [] and ix.list_snapshots()[0].id == a


def test_0007_remote_store_ids_migrate_down_and_up_in_place(index_url: str) -> None:
    """0007 adds ``remotes.store_id``; downgraded, every remote and what it holds stays; upgraded
    again, the ids are unknown (NULL), a remote that holds snapshots still counts as used, and
    the next open records the id it finds (compare-and-set: never overwritten)."""
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        a = _commit(ix, "r", ["a"], "p1" * 32)
        ix.add_remote(RemoteRecord("origin", "/x", options={"anon": True}, store_id="ab" * 16))
        ix.add_remote(RemoteRecord("fresh", "/y"))
        ix.mark_pushed("origin", [a])
        assert [r.store_id for r in ix.list_remotes()] == [None, "ab" * 16]
        assert ix.remote_used("origin") and not ix.remote_used("fresh")
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0006")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT * FROM remotes WHERE name = 'origin'")).mappings().one()
            assert "store_id" not in row and row["url"] == "/x"
    finally:
        engine.dispose()
    with pytest.raises(SchemaError, match="ckstore migrate"):
        Index.open(index_url, create=False)
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        got = ix.get_remote("origin")
        assert got is not None and (got.url, got.options, got.store_id) == (
            "/x",
            {"anon": True},
            None,
        )
        assert ix.remote_holdings() == {a: {"origin"}}
        assert ix.remote_used("origin") and not ix.remote_used("fresh")  # holds snapshots: used
        assert ix.record_remote_store_id("origin", "cd" * 16) == "cd" * 16
        assert ix.record_remote_store_id("origin", "ef" * 16) == "cd" * 16  # never overwritten
        assert ix.remote_used("fresh") is False and ix.record_remote_store_id("nope", "x") is None
