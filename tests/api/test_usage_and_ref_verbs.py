"""The verbs the faces call (issue 30, item 2): disk usage, what a snapshot stores and shares,
write sessions, forks, tag records, deleting a run, and a take driven from outside ``take``.

Each verb answers what the index says, and the command line and the web view print what the
verbs return (their own tests check the output); here each verb is checked against a store
whose sharing is known: run ``a`` takes ``w`` twice unchanged then changes it, run ``b`` forks
from ``a@1`` (same ``w``), run ``c`` shares nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.engine.take.spec import TakeSpec
from ckstore.errors import ConflictError, NotFoundError, ReadOnlyStoreError

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _state(w: torch.Tensor, step: int) -> dict[str, ckstore.StateDict]:
    return {"m": ckstore.StateDict(w=w, step=step)}


@pytest.fixture
def store(tmp_path: Path):
    base = torch.arange(2048.0)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **TINY) as s:
        s.take(_state(base, 1), run="a", step=1)
        s.take(_state(base, 2), run="a", step=2)
        s.take(_state(base * 2, 3), run="a", step=3)
        s.take(_state(base, 0), run="b", step=0)
        s.take(_state(torch.full((2048,), 7.0), 0), run="c", step=0)
        yield s


def test_du_rows_agree_with_the_snapshots(store) -> None:
    rows = store.du()
    assert [r.run for r in rows] == ["a", "b", "c", None]
    by_run = {r.run: r for r in rows}
    assert by_run["a"].snapshots == 3 and by_run[None].snapshots == 5
    assert by_run["a"].logical_bytes == sum(s.stats["logical_bytes"] for s in store.log(run="a"))
    # b shares every chunk with a@1, so nothing of b is its own; c shares nothing
    assert by_run["b"].exclusive_bytes == 0
    assert by_run["c"].exclusive_bytes == by_run["c"].stored_bytes > 0
    assert by_run[None].exclusive_bytes is None and by_run[None].packs
    assert store.exclusive_bytes() == {
        r.run: r.exclusive_bytes for r in rows[:-1] if r.exclusive_bytes
    }
    seen: list[str] = []
    store.du(progress=lambda packs: (seen.append(p) or p for p in packs))
    assert len(seen) == by_run[None].packs


def test_a_snapshot_says_what_it_stores_and_shares(store) -> None:
    a1, a3, b0, c0 = (store.get(r) for r in ("a@1", "a@3", "b@0", "c@0"))
    assert a1.stored_bytes() == b0.stored_bytes() > 0
    assert [(e.key, e.kind) for e in a1.entries()] == [("m/w", "tensor"), ("m/step", "value")]
    assert a1.entries()[0].shape == (2048,) and a1.entries()[0].nbytes == 8192
    assert a1.exclusive_usage() == (0, 0)  # a@2 and b@0 hold the same chunks
    chunks, size = c0.exclusive_usage()
    assert chunks > 0 and size == c0.stored_bytes()
    shared = {s.snapshot_id: s for s in a1.shared_with([b0.id, a3.id, c0.id, "0" * 64])}
    assert set(shared) == {b0.id}  # a@3 changed w, c never had it; unknown ids share nothing
    assert shared[b0.id].stored_bytes == a1.stored_bytes()


def test_fork_sources_name_the_snapshot_a_run_started_from(store) -> None:
    b0, c0 = store.get("b@0"), store.get("c@0")
    found = store.fork_sources([b0.id, c0.id], sample=4)
    assert {h.snapshot_id for h in found[b0.id]} == {store.get("a@1").id, store.get("a@2").id}
    assert found[c0.id] == []
    with pytest.raises(ckstore.errors.InvalidInputError):
        store.fork_sources([b0.id], sample=0)


def test_tag_records_and_delete_run(store) -> None:
    store.tag("a@1", "best")
    store.tag("a@3", "best", force=True)
    (rec,) = store.tag_records()
    assert (rec.name, rec.snapshot_id, rec.version) == ("best", store.get("a@3").id, 2)
    assert store.tags() == {"best": rec.snapshot_id}
    with pytest.raises(ConflictError, match="best"):
        store.delete_run("a")
    assert len(store.log(run="a")) == 3  # nothing was deleted
    gone = store.delete_run("a", force=True)
    assert [r.step for r in gone] == [3, 2, 1] and store.tags() == {}
    assert store.runs() == ["b", "c"]
    with pytest.raises(NotFoundError, match="no run 'a'"):
        store.delete_run("a")


def test_sessions_name_a_take_in_progress(store) -> None:
    assert store.sessions() == []
    spec = TakeSpec.of(run="dcp-like", step=1)
    take = store.local_take(spec)
    try:
        sid = take.session  # begun beside the caller's work: this waits for it
        (held,) = store.sessions()
        assert held.session.id == sid and held.pinned_chunks == 0 and held.held_bytes == 0
    finally:
        take.close()  # never committed: it aborts
    assert store.sessions() == [] and "dcp-like" not in store.runs()


def test_index_url_and_a_read_only_store(store, tmp_path: Path) -> None:
    assert store.index_url.startswith("sqlite:///") and store.index_url.endswith("index.sqlite")
    with ckstore.open(store.url, read_only=True) as ro:
        assert ro.index_url == store.index_url
        with pytest.raises(ReadOnlyStoreError):
            ro.delete_run("c")
        take = ro.local_take(TakeSpec.of(run="x"))
        try:
            with pytest.raises(ReadOnlyStoreError):
                take.session  # noqa: B018 - the session begins, or says why not
        finally:
            take.close()
