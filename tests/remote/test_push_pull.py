"""push, pull and clone between stores of every kind (local, moto S3 + PostgreSQL, SeaweedFS):
only what the other side lacks travels, history arrives whole (ids, parents, tags, metadata),
deltas arrive decodable, compaction on either side never makes a chunk travel twice, and a
damaged chunk is named instead of copied."""

from __future__ import annotations

import pytest

import ckstore
from ckstore import errors, objects
from ckstore.remote import config
from tests.support.remotes import KNOBS, fill, history, restores, same_history


def _add(store: ckstore.Store, spec: dict, name: str = "origin") -> None:
    store.add_remote(
        name, spec["url"], index=spec["index"], storage_options=spec["storage_options"]
    )


def test_push_sends_each_chunk_once_and_history_arrives_whole(
    source, remote_spec, open_remote, tmp_path
) -> None:
    _add(source, remote_spec)
    first = source.push("origin")
    assert first.created and len(first.snapshots_sent) == 4 and first.tags_set == ["best"]
    remote = open_remote()
    assert same_history(source, remote)  # ids, runs, steps, parents, metadata, health, tags
    assert remote.check(read_data=True).ok
    assert all(restores(remote, f"r@{step}", step) for step in (1, 2, 3)) and restores(
        remote, "s", 10
    )
    chunks = {c.chunk_id for c in remote.repository.index.all_chunks()}
    assert first.stats.chunks_sent == len(chunks)  # every chunk sent once, shared ones skipped
    assert {s.state for s in source.push_status().values()} == {"pushed"}

    again = source.push("origin")
    assert (
        again.snapshots_sent == [] and again.snapshots_present == 4 and again.stats.bytes_sent == 0
    )

    snap = fill(source, "r", [4])[0]
    third = source.push("origin", ["r"])
    new = source.repository.index.snapshot_chunk_ids(snap.id) - chunks
    assert third.snapshots_sent == [snap.ref] and third.stats.chunks_sent == len(new)
    assert third.stats.bytes_sent == sum(
        c.length for c in source.repository.index.chunk_locations(new).values()
    )
    assert remote.get("r").parent_id == source.get("r@3").id

    clone = ckstore.clone(
        remote_spec["url"],
        tmp_path / "clone",
        index=remote_spec["index"],
        storage_options=remote_spec["storage_options"],
    )
    try:
        assert same_history(source, clone) and restores(clone, "r", 4)
        assert [r.name for r in clone.remotes()] == [
            "origin"
        ] and clone.config.chunk_bytes == KNOBS["chunk_bytes"]
        assert clone.check(read_data=True).ok
    finally:
        clone.close()


def test_refs_choose_what_travels(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin", ["best"])  # a tag: its snapshot and the tag
    with ckstore.open(tmp_path / "remote") as remote:
        assert [s.ref for s in remote.log()] == [
            source.get("r@2").ref
        ] and remote.tags() == source.tags()
        assert remote.get("r@2").parent_id is None  # r@1 is not there: its run starts with r@2
    source.push("origin", ["r@3", "s"])  # one snapshot, and a whole run
    with ckstore.open(tmp_path / "remote") as remote:
        assert sorted(s.ref for s in remote.log()) == sorted(
            [source.get(r).ref for r in ("r@2", "r@3", "s")]
        )
        assert remote.get("r@3").parent_id == source.get("r@2").id
    with pytest.raises(errors.SnapshotNotFoundError):
        source.push("origin", ["nothing-of-that-name"])
    with pytest.raises(errors.NotFoundError, match="no remote named 'upstream'"):
        source.push("upstream")


def test_pull_brings_what_is_new_and_keeps_what_is_here(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.clone(tmp_path / "remote", tmp_path / "mine") as mine:
        fill(mine, "mine", [1])
        fill(source, "r", [4, 5])
        source.push("origin")
        report = mine.pull("origin")
        assert len(report.snapshots_sent) == 2 and report.snapshots_present == 4
        assert restores(mine, "r", 5) and restores(mine, "mine", 1)
        states = {s: mine.push_status()[mine.get(s).id].state for s in ("r@5", "mine")}
        assert states == {
            "r@5": "pushed",
            "mine": "local",
        }  # pulled from there: the remote holds it
        assert mine.check(read_data=True).ok


def test_deltas_travel_as_deltas_or_whole(tmp_path) -> None:
    """A delta whose base the destination lacks is sent whole; with its base there, as a delta."""
    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", [1, 2, 3], delta_base="parent")
    deltas = {c.chunk_id for c in src.repository.index.all_chunks() if c.base_id is not None}
    assert deltas, "the takes stored no delta"
    src.add_remote("origin", tmp_path / "remote")
    only_last = src.push("origin", ["r@3"])
    assert only_last.stats.chunks_whole > 0
    rest = src.push("origin", ["r"])
    assert rest.stats.chunks_whole == 0  # each base was there by then (parents commit first)
    with ckstore.open(tmp_path / "remote") as remote:
        rows = {c.chunk_id: c for c in remote.repository.index.all_chunks()}
        assert any(rows[c].base_id is not None for c in deltas if c in rows)
        assert remote.check(read_data=True).ok
        assert all(restores(remote, f"r@{s}", s) for s in (1, 2, 3))
    src.close()


def test_compaction_on_either_side_never_sends_a_chunk_twice(tmp_path) -> None:
    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", [1, 2, 3])
    src.add_remote("origin", tmp_path / "remote")
    src.push("origin")
    assert src.compact().chunks > 0  # r@1 and r@2 rewritten densely (new payloads, same ids)
    assert src.push("origin").stats.chunks_sent == 0
    with ckstore.open(tmp_path / "remote") as remote:
        assert remote.compact().chunks > 0  # what arrived loose, densified there
        assert remote.check(read_data=True).ok
    snap = fill(src, "r", [4])[0]
    assert src.compact().chunks > 0  # r@3, pushed loose, now dense here
    with ckstore.open(tmp_path / "remote") as remote:
        had = {c.chunk_id for c in remote.repository.index.all_chunks()}
    report = src.push("origin")
    assert report.stats.chunks_sent == len(src.repository.index.snapshot_chunk_ids(snap.id) - had)
    src.close()


def test_a_chunk_compacted_while_it_is_pushed_is_sent_from_its_new_place(
    tmp_path, monkeypatch
) -> None:
    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", [1, 2, 3])
    src.add_remote("origin", tmp_path / "remote")
    locate = src.repository.index.chunk_locations
    compacted: list[int] = []

    def located_then_compacted(ids):
        found = locate(ids)
        if (
            not compacted
        ):  # the push located what it reads; compaction now deletes those loose packs
            compacted.append(0)
            compacted[0] = src.compact().chunks
        return found

    monkeypatch.setattr(src.repository.index, "chunk_locations", located_then_compacted)
    report = src.push("origin")
    assert compacted and compacted[0] > 0 and report.stats.chunks_whole > 0
    with ckstore.open(tmp_path / "remote") as remote:
        assert remote.check(read_data=True).ok and all(
            restores(remote, f"r@{s}", s) for s in (1, 2, 3)
        )
    src.close()


def test_a_damaged_chunk_of_the_remote_is_named_on_pull(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.open(tmp_path / "remote") as remote:
        victim = remote.get("r@1")
        cid = sorted(remote.repository.index.snapshot_chunk_ids(victim.id))[0]
        rec = remote.repository.index.chunk_locations([cid])[cid]
    pack = tmp_path / "remote" / objects.pack_name(rec.pack_id)
    data = bytearray(pack.read_bytes())
    data[rec.offset] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    with ckstore.open(tmp_path / "mine", create=True) as mine:
        mine.add_remote("origin", tmp_path / "remote")
        with pytest.raises(errors.CorruptionError) as err:
            mine.pull("origin", ["r@1"])
        message = str(err.value)
        assert cid in message and rec.pack_id in message and str(tmp_path / "remote") in message
        assert mine.log() == [] and mine.check().ok  # nothing of it committed here
        mine.pull("origin", ["s"])  # what is not damaged still comes
        assert restores(mine, "s", 10)
    with ckstore.open(tmp_path / "remote") as remote:
        assert not remote.check(read_data=True).ok


def test_tags_held_elsewhere_move_only_with_force(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    source.tag("r@3", "best", force=True)
    fill(source, "r", [4])
    with pytest.raises(errors.ConflictError, match="best"):
        source.push("origin")
    with ckstore.open(tmp_path / "remote") as remote:
        assert remote.tags()["best"] == source.get("r@2").id and restores(
            remote, "r", 4
        )  # the rest went
    assert source.push("origin", force=True).tags_set == ["best"]
    with ckstore.open(tmp_path / "remote") as remote:
        assert remote.tags() == source.tags()


def test_names_that_clash_at_the_destination_are_refused_by_name(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    with ckstore.open(tmp_path / "remote", create=True, **KNOBS) as remote:
        fill(remote, "other", [1], tags={1: ["s"]})  # a tag named like the run `s`
    with pytest.raises(errors.ConflictError, match="'s'"):
        source.push("origin", ["s"])
    source.push("origin", ["r"])
    with pytest.raises(errors.InvalidInputError, match="this store itself"):
        source.add_remote("self", source.url)
        source.push("self")


def test_an_interrupted_push_resumes_without_sending_again_what_arrived(
    source, tmp_path, monkeypatch
) -> None:
    with ckstore.open(tmp_path / "clean", create=True, **KNOBS) as clean_dst:
        clean = ckstore.remote.transfer(
            source.repository,
            clean_dst.repository,
            ckstore.remote.select(source.repository.index, []),
            direction="push",
            remote="clean",
            record=lambda ids: None,
        ).stats.chunks_sent
    source.add_remote("origin", tmp_path / "remote")
    real = config.open_or_create

    def failing(index, record, like):
        repo, created = real(index, record, like)
        repo.objects = objects.ObjectStore(
            objects.FaultyBackend(repo.objects.backend, fail_put_at=4)
        )
        return repo, created

    monkeypatch.setattr(config, "open_or_create", failing)
    with pytest.raises(errors.StorageError, match="injected fault"):
        source.push("origin")
    monkeypatch.setattr(config, "open_or_create", real)
    with ckstore.open(tmp_path / "remote") as remote:
        arrived = {c.chunk_id for c in remote.repository.index.all_chunks()}
        assert arrived and len(remote.log()) < 4  # some packs (and maybe snapshots) arrived
    report = source.push("origin")
    assert report.stats.chunks_sent == clean - len(arrived)  # nothing that arrived went twice
    with ckstore.open(tmp_path / "remote") as remote:
        assert same_history(source, remote) and remote.check(read_data=True).ok
    assert history(source)


def test_push_and_pull_tell_progress_in_stored_bytes(source, tmp_path) -> None:
    source.add_remote("origin", tmp_path / "remote")
    told: list[tuple[str, int, int]] = []
    report = source.push(
        "origin", progress=lambda what, done, total: told.append((what, done, total))
    )
    assert {w for w, _, _ in told} == {"push"} and told[-1][1] == told[-1][2] > 0
    assert told[-1][2] == report.stats.bytes_sent + report.stats.bytes_skipped
    assert [d for _, d, _ in told] == sorted(d for _, d, _ in told)
    told.clear()
    with ckstore.clone(tmp_path / "remote", tmp_path / "mine", progress=lambda *a: told.append(a)):
        assert told[0] == ("pull", 0, told[-1][2]) and told[-1][1] == told[-1][2] > 0
