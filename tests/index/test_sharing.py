"""The sharing queries of the index (what snapshots have in common), on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ckstore.errors import InvalidInputError
from ckstore.index import ChunkRecord, Index, PackRecord

from .helpers import ENTRIES, cid, commit, snapshot


@pytest.fixture
def ix(index_url: str) -> Iterator[Index]:
    index = Index.open(index_url)
    yield index
    index.close()


def _commit_with_delta(ix: Index, run: str, step: int, base_label: str, label: str) -> str:
    """A snapshot whose one chunk is a delta against the chunk ``base_label``."""
    session = ix.begin_session("test", 30)
    rec = ChunkRecord(
        cid(label), f"pack-{label}", 0, 5, 64, "zstd", base_id=cid(base_label), depth=1
    )
    ix.add_pack(session.id, PackRecord(f"pack-{label}", 100, 1), [rec])
    ix.lookup_chunks(session.id, [cid(base_label)])
    return ix.commit_snapshot(session.id, snapshot(run, step), ENTRIES, [rec.chunk_id], 1).id


def test_shared_with_counts_common_chunks_and_bytes(ix: Index) -> None:
    a = commit(ix, "r", 1, ["x", "y", "shared"])
    b = commit(ix, "r", 2, ["x", "z", "shared"])
    c = commit(ix, "q", 1, ["w"])
    got = ix.shared_with(a.id, [b.id, c.id, a.id, "no-such-snapshot"])
    assert [(s.snapshot_id, s.chunks) for s in got] == [(b.id, 2)]
    assert got[0].stored_bytes > 0
    assert ix.shared_with(a.id, []) == []


def test_exclusive_usage_is_what_no_other_snapshot_references(ix: Index) -> None:
    a = commit(ix, "r", 1, ["x", "only-a1", "only-a2"])
    commit(ix, "r", 2, ["x"])
    n, size = ix.exclusive_usage(a.id)
    assert n == 2 and size > 0
    assert ix.exclusive_usage("no-such-snapshot") == (0, 0)


def test_fork_sources_find_the_base_by_shared_chunks_and_delta_bases(ix: Index) -> None:
    base1 = commit(ix, "base", 1, ["b1", "b2"])
    time.sleep(0.01)
    base2 = commit(ix, "base", 2, ["b1", "b3"])
    time.sleep(0.01)
    shared = commit(ix, "sft", 1, ["b1", "b3", "s1"])  # a frozen backbone: keeps base@2's chunks
    time.sleep(0.01)
    delta = _commit_with_delta(ix, "lora", 1, "b2", "d1")  # stores its change against base@1's
    lone = commit(ix, "lone", 1, ["n1"])
    got = ix.fork_sources([shared.id, delta, lone.id, "no-such-snapshot"])
    assert got[shared.id][0].snapshot_id == base2.id and got[shared.id][0].chunks == 2
    assert base1.id in {s.snapshot_id for s in got[shared.id]}
    assert [s.snapshot_id for s in got[delta]] == [base1.id]
    assert got[lone.id] == [] and got["no-such-snapshot"] == []


def test_fork_sources_ignore_later_snapshots_and_the_same_run(ix: Index) -> None:
    first = commit(ix, "r", 1, ["a"])
    commit(ix, "r", 2, ["a"])
    time.sleep(0.01)
    commit(ix, "later", 1, ["a"])
    assert ix.fork_sources([first.id]) == {first.id: []}


@pytest.mark.parametrize("sample", [0, -1, 2000, 1.5, True])
def test_fork_sources_refuse_a_bad_sample(ix: Index, sample: object) -> None:
    with pytest.raises(InvalidInputError):
        ix.fork_sources([], sample=sample)  # type: ignore[arg-type]
