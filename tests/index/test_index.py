"""Conformance suite of the index, run on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ckstore.errors import (
    ConflictError,
    InvalidInputError,
    LeaseExpiredError,
    NotFoundError,
    SnapshotNotFoundError,
)
from ckstore.index import Index, PackRecord, validate_name

from .helpers import ENTRIES, add_chunks, cid, commit, snapshot


@pytest.fixture
def ix(index_url: str) -> Iterator[Index]:
    index = Index.open(index_url)
    yield index
    index.close()


def test_open_properties(ix: Index, index_url: str) -> None:
    assert ix.dialect in ("sqlite", "postgresql")
    assert ix.url.split("://")[0] in index_url
    again = Index.open(index_url)  # an existing index at head opens
    again.close()


def test_open_without_create_refuses_empty(tmp_path) -> None:
    with pytest.raises(NotFoundError):
        Index.open(f"sqlite:///{tmp_path / 'none.sqlite'}", create=False)


def test_memory_sqlite() -> None:
    with Index.open("sqlite:///:memory:") as index:
        commit(index, "r", 1)
        assert index.list_runs() == ["r"]


def test_meta(ix: Index) -> None:
    assert ix.get_meta("format") is None
    assert ix.set_meta("format", "1") == "1"
    assert ix.set_meta("format", "2", only_if_absent=True) == "1"
    assert ix.set_meta("format", "3") == "3"
    assert ix.get_meta("format") == "3"


def test_session_lifecycle(ix: Index) -> None:
    s = ix.begin_session("host:1", 30)
    assert s.state == "active" and s.expires_at > s.started_at
    ix.heartbeat(s.id, 60)
    ix.end_session(s.id, "aborted")
    with pytest.raises(LeaseExpiredError):
        ix.heartbeat(s.id, 60)
    with pytest.raises(InvalidInputError):
        ix.end_session(s.id, "weird")
    with pytest.raises(NotFoundError):
        ix.end_session("nope", "aborted")
    with pytest.raises(InvalidInputError):
        ix.begin_session("x", 0)


def test_expired_lease_blocks_lookup_and_commit(ix: Index) -> None:
    writer = ix.begin_session("w", 30)
    ids = add_chunks(ix, writer.id, "p0", ["a", "b"])
    short = ix.begin_session("slow", 0.05)
    time.sleep(0.12)
    with pytest.raises(LeaseExpiredError):
        ix.heartbeat(short.id, 30)
    with pytest.raises(LeaseExpiredError):
        ix.lookup_chunks(short.id, ids)
    with pytest.raises(LeaseExpiredError):
        add_chunks(ix, short.id, "p1", ["c"])
    with pytest.raises(LeaseExpiredError):
        ix.commit_snapshot(short.id, snapshot("r", 1), ENTRIES, ids, 10, tags=["t"])
    assert ix.list_snapshots() == [] and ix.list_runs() == [] and ix.list_tags() == []
    assert ix.chunk_locations([cid("c")]) == {}
    assert _pins(ix, short.id) == set()


def _pins(ix: Index, session_id: str) -> set[str]:
    from sqlalchemy import select

    from ckstore.index._sql import pins

    with ix._read("test") as conn:  # white-box: pins are GC's business, not public API
        return set(conn.scalars(select(pins.c.chunk_id).where(pins.c.session_id == session_id)))


def test_lookup_pins_found_chunks(ix: Index) -> None:
    writer = ix.begin_session("w", 30)
    ids = add_chunks(ix, writer.id, "p0", [f"c{i}" for i in range(3)])
    ix.end_session(writer.id, "committed")
    assert _pins(ix, writer.id) == set()
    reader = ix.begin_session("r", 30)
    wanted = ids + [cid(f"missing{i}") for i in range(1200)]  # several batches
    found = ix.lookup_chunks(reader.id, wanted)
    assert set(found) == set(ids)
    assert found[ids[1]].pack_id == "p0" and found[ids[1]].offset == 100
    assert found[ids[1]].length == 11 and found[ids[1]].codec == "zstd"
    assert _pins(ix, reader.id) == set(ids)
    assert ix.lookup_chunks(reader.id, ids) == found  # pinning twice is fine
    ix.end_session(reader.id, "aborted")
    assert _pins(ix, reader.id) == set()


def test_add_pack_is_idempotent(ix: Index) -> None:
    s = ix.begin_session("w", 30)
    ids = add_chunks(ix, s.id, "p0", ["a", "b"])
    add_chunks(ix, s.id, "p0", ["a", "b"])
    from .helpers import ChunkRecord

    # the same chunk in a second pack keeps its first location
    ix.add_pack(s.id, PackRecord("p1", 10, 1), [ChunkRecord(ids[0], "p1", 0, 5, 64, "none")])
    locations = ix.chunk_locations(ids + [cid("zz")])
    assert set(locations) == set(ids)
    assert locations[ids[0]].pack_id == "p0"
    assert _pins(ix, s.id) == set(ids)
    with pytest.raises(InvalidInputError):
        ix.add_pack(s.id, PackRecord("p2", 10, 1), [ChunkRecord(ids[0], "p1", 0, 5, 64, "x")])


def test_commit_and_read_back(ix: Index) -> None:
    rec = commit(ix, "sft", 100, name="first", tags=["best", "v1"])
    assert rec.parent_id is None
    got = ix.get_snapshot(rec.id)
    assert got == rec
    assert got.metadata == {"loss": 1.5, "note": "x"} and got.world_size == 2
    assert ix.entries(rec.manifest_id) == ENTRIES
    assert ix.snapshot_chunk_ids(rec.id) == {cid("sft-100-a"), cid("shared")}
    assert ix.stored_bytes(rec.id) == 10 + 11
    assert [t.name for t in ix.list_tags(rec.id)] == ["best", "v1"]
    with pytest.raises(SnapshotNotFoundError):
        ix.get_snapshot("0" * 64)


def test_commit_requires_known_chunks(ix: Index) -> None:
    s = ix.begin_session("w", 30)
    ids = add_chunks(ix, s.id, "p0", ["a"])
    with pytest.raises(NotFoundError, match=cid("ghost")):
        ix.commit_snapshot(s.id, snapshot("r", 1), ENTRIES, ids + [cid("ghost")], 10)
    assert ix.list_snapshots() == [] and ix.list_runs() == []
    ix.commit_snapshot(s.id, snapshot("r", 1), ENTRIES, ids, 10)  # session still usable


def test_commit_ends_session(ix: Index) -> None:
    s = ix.begin_session("w", 30)
    ids = add_chunks(ix, s.id, "p0", ["a"])
    ix.commit_snapshot(s.id, snapshot("r", 1), ENTRIES, ids, 10)
    assert _pins(ix, s.id) == set()
    with pytest.raises(LeaseExpiredError):
        ix.commit_snapshot(s.id, snapshot("r", 2), ENTRIES, ids, 10)


def test_parent_chaining(ix: Index) -> None:
    a = commit(ix, "run", 1)
    b = commit(ix, "run", 2)
    other = commit(ix, "other", 1)
    c = commit(ix, "run", 3, created_at=0.0)  # parent follows commit order, not created_at
    assert (a.parent_id, b.parent_id, c.parent_id) == (None, a.id, b.id)
    assert other.parent_id is None
    assert ix.resolve("run").id == c.id


def test_shared_manifest_is_stored_once(ix: Index) -> None:
    a = commit(ix, "run", 1, manifest="same")
    b = commit(ix, "run", 2, manifest="same")
    assert a.manifest_id == b.manifest_id == "same"
    assert ix.entries("same") == ENTRIES


def test_name_and_id_conflicts(ix: Index) -> None:
    commit(ix, "run", 1, name="ckpt/one")
    with pytest.raises(ConflictError, match="ckpt/one"):
        commit(ix, "run", 2, name="ckpt/one")
    existing = commit(ix, "run", 3)
    with pytest.raises(ConflictError):
        commit(ix, "run", 4, sid=existing.id)
    assert [s.step for s in ix.list_snapshots("run")] == [3, 1]


def test_resolve_every_form(ix: Index) -> None:
    s1 = commit(ix, "sft", 100, sid="abcd0" + "0" * 59)
    s2 = commit(ix, "sft", 200, sid="abcd1" + "1" * 59, name="named")
    s3 = commit(ix, "sft", 100, sid="ffff" + "2" * 60)  # same step again: newest wins
    ix.set_tag("best", s1.id)
    assert ix.resolve("sft@200").id == s2.id
    assert ix.resolve("sft@100").id == s3.id
    assert ix.resolve("best").id == s1.id
    assert ix.resolve("named").id == s2.id
    assert ix.resolve("sft").id == s3.id
    assert ix.resolve("abcd0").id == s1.id
    assert ix.resolve("ABCD1").id == s2.id
    assert ix.resolve("ffff").id == s3.id
    assert ix.resolve(s3.id).id == s3.id


def test_resolve_precedence(ix: Index) -> None:
    target = commit(ix, "a", 1)
    commit(ix, "shadow", 1)
    with pytest.raises(ConflictError, match="would hide run"):  # issue 27, item 6
        ix.set_tag("shadow", target.id)  # a tag would shadow the run of the same name
    ix.set_tag("tagged", target.id)
    assert ix.resolve("tagged").id == target.id
    with pytest.raises(ConflictError, match="would hide run 'a'"):  # names keep one meaning
        commit(ix, "b", 1, name="a")
    named = commit(ix, "b", 1, name="first")  # a snapshot's name resolves to it
    assert ix.resolve("first").id == named.id
    with pytest.raises(ConflictError, match="would be hidden by the snapshot named"):
        commit(ix, "first", 1)


def test_resolve_errors(ix: Index) -> None:
    commit(ix, "sft", 100, sid="abcd0" + "0" * 59)
    commit(ix, "sft", 200, sid="abcd1" + "1" * 59)
    commit(ix, "other", 1, tags=["best"])
    with pytest.raises(InvalidInputError, match="ambiguous") as amb:
        ix.resolve("abcd")
    assert "abcd0" in str(amb.value) and "abcd1" in str(amb.value)
    with pytest.raises(SnapshotNotFoundError) as err:
        ix.resolve("nothing")
    message = str(err.value)
    assert "'nothing'" in message and "tag" in message and "run@step" in message
    assert "other, sft" in message and "best" in message
    with pytest.raises(SnapshotNotFoundError, match="step 300"):
        ix.resolve("sft@300")
    with pytest.raises(SnapshotNotFoundError):
        ix.resolve("abc")  # 3 hex digits are too few for a prefix
    with pytest.raises(InvalidInputError, match="step number"):
        ix.resolve("sft@latest")
    with pytest.raises(KeyError):  # SnapshotNotFoundError is also a KeyError
        ix.resolve("zzz")


def test_list_ordering(ix: Index) -> None:
    a = commit(ix, "a", 1, created_at=10.0)
    b = commit(ix, "b", 1, created_at=30.0)
    c = commit(ix, "a", 2, created_at=20.0)
    assert [s.id for s in ix.list_snapshots()] == [b.id, c.id, a.id]
    assert [s.id for s in ix.list_snapshots(limit=2)] == [b.id, c.id]
    assert [s.id for s in ix.list_snapshots("a")] == [c.id, a.id]
    assert ix.list_snapshots("nope") == []
    assert ix.list_runs() == ["a", "b"]


def test_tags(ix: Index) -> None:
    a = commit(ix, "run", 1)
    b = commit(ix, "run", 2)
    t = ix.set_tag("best", a.id)
    assert (t.snapshot_id, t.version) == (a.id, 1)
    with pytest.raises(ConflictError, match="force"):
        ix.set_tag("best", b.id)
    t = ix.set_tag("best", b.id, force=True)
    assert (t.snapshot_id, t.version) == (b.id, 2)
    t = ix.set_tag("best", a.id, expected_version=2)
    assert (t.snapshot_id, t.version) == (a.id, 3)
    with pytest.raises(ConflictError, match="version 3"):
        ix.set_tag("best", b.id, expected_version=2)
    assert ix.get_tag("best").snapshot_id == a.id  # type: ignore[union-attr]
    with pytest.raises(ConflictError):
        ix.set_tag("best", b.id, expected_version=0)
    assert ix.set_tag("new", b.id, expected_version=0).version == 1
    with pytest.raises(SnapshotNotFoundError):
        ix.set_tag("x", "0" * 64)
    with pytest.raises(InvalidInputError):
        ix.set_tag("bad@name", a.id)
    assert [t.name for t in ix.list_tags()] == ["best", "new"]
    ix.delete_tag("best")
    assert ix.get_tag("best") is None
    with pytest.raises(NotFoundError):
        ix.delete_tag("best")


def test_commit_moves_tags(ix: Index) -> None:
    a = commit(ix, "run", 1, tags=["latest"])
    with pytest.raises(ConflictError, match="move_tags"):  # a plain spec never moves a tag
        commit(ix, "run", 2, tags=["latest"])
    b = commit(ix, "run", 2, tags=["+latest"])  # "+name" moves it (issue 27, item 9)
    tag = ix.get_tag("latest")
    assert tag is not None and (tag.snapshot_id, tag.version) == (b.id, 2)
    assert ix.list_tags(a.id) == []
    with pytest.raises(InvalidInputError):
        commit(ix, "run", 3, tags=["../x"])
    assert len(ix.list_snapshots()) == 2


def test_delete_snapshot(ix: Index) -> None:
    a = commit(ix, "run", 1)
    b = commit(ix, "run", 2, tags=["best"])
    c = commit(ix, "run", 3)
    ix.delete_snapshot(b.id)
    with pytest.raises(SnapshotNotFoundError):
        ix.get_snapshot(b.id)
    assert ix.get_tag("best") is None
    assert ix.snapshot_chunk_ids(b.id) == set()
    assert ix.get_snapshot(c.id).parent_id == a.id
    assert ix.chunk_locations([cid("run-2-a")])  # chunk rows stay for GC
    assert ix.entries(b.manifest_id) == ENTRIES
    with pytest.raises(SnapshotNotFoundError):
        ix.delete_snapshot(b.id)
    d = commit(ix, "run", 4)
    assert d.parent_id == c.id


@pytest.mark.parametrize(
    "name",
    ["", "a" * 129, "/a", "a/", "-a", "a..b", "a//b", "a@1", "a b", "é", "a\n"],
)
def test_validate_name_refuses(name: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        validate_name(name, "tag")
    assert "tag" in str(err.value)


@pytest.mark.parametrize("name", ["a", "run-1", "sft/lora.v2", "A_b-C.d/e", "a" * 128, "1"])
def test_validate_name_accepts(name: str) -> None:
    assert validate_name(name, "run") == name
