"""The reads a resume makes through the standard library's sqlite3 (``index/lite.py``) answer
what the full index answers, or leave the answer to it; a fresh process's resume never loads
SQLAlchemy, and everything else still finds the full index."""

from __future__ import annotations

import ast
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import IndexCorruptionError, SnapshotNotFoundError
from ckstore.index import Index, current_revision, head_revision, make_engine
from ckstore.index.lite import HEAD_REVISION, UNSURE, LiteReads

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g)
    return {"w": w, "b": torch.randn(4096, generator=g).to(torch.bfloat16)}


def _history(root: Path) -> tuple[ckstore.Store, Path]:
    """A store with runs, repeated steps, names, tags, deltas and health of every kind."""
    store = ckstore.open(root, create=True, auto_compact=False)
    base = _state(0)
    for step in range(4):
        base["w"][step].add_(1.0)  # most rows unchanged: later snapshots share and delta
        store.take(
            {"m": ckstore.StateDict(base)}, run="a", step=step, tags=["best"] if step == 2 else ()
        )
    store.take({"m": ckstore.StateDict(base)}, run="a", step=3)  # step 3 twice: the newer wins
    store.take({"m": ckstore.StateDict(_state(1))}, run="b", step=10, name="named-one")
    store.take({"m": ckstore.StateDict(_state(2))}, run="c/nested", step=0)
    store.compact(keep_loose=0)
    db = root / "index.sqlite"
    con = sqlite3.connect(db)
    with con:  # health of every kind, and a pack that lives on a remote
        ids = [r[0] for r in con.execute("SELECT id FROM snapshots WHERE run = 'a' ORDER BY seq")]
        con.execute("UPDATE snapshots SET nonfinite = 0, stale = NULL, diverged = NULL")
        con.execute("UPDATE snapshots SET nonfinite = 3 WHERE id = ?", (ids[-1],))
        con.execute("UPDATE snapshots SET stale = 1 WHERE id = ?", (ids[-2],))
        con.execute("UPDATE snapshots SET diverged = 2 WHERE id = ?", (ids[-3],))
        con.execute("UPDATE snapshots SET nonfinite = NULL WHERE run = 'c/nested'")
        pack = con.execute("SELECT id FROM packs LIMIT 1").fetchone()[0]
        con.execute("UPDATE packs SET remote = 'far' WHERE id = ?", (pack,))
    con.close()
    return store, db


def _refs(index: Index) -> list[str]:
    snaps = index.list_snapshots()
    refs = ["a", "b", "c/nested", "best", "named-one", "a@healthy", "b@healthy", "c/nested@healthy"]
    for s in snaps:
        refs += [s.id, s.id[:6], s.id[:12].upper(), f"{s.run}@{s.step}", f"{s.run}@+{s.step}"]
        refs.append(f"x@{s.step} ({s.id[:12]})")
    refs += ["nope", "a@99", "a@-1", "a@x", "@3", "a@", "a@1_0", "a@ 1", "ffff", "zz@healthy", ""]
    return refs


def test_every_answer_is_the_full_index_answer_and_the_common_refs_are_answered(
    tmp_path: Path,
) -> None:
    store, db = _history(tmp_path / "s")
    index = store.repository.index
    lite = LiteReads.open(str(db), store.repository.config.store_id)
    assert lite is not None
    answered = 0
    for ref in _refs(index):
        mine = lite.resolve(ref)
        try:
            theirs: Any = index.resolve(ref)
        except ckstore.CkstoreError as exc:
            theirs = type(exc)
        if mine is not UNSURE:
            answered += 1
            assert mine == theirs, ref
    for ref in ("a", "best", "named-one", "a@healthy", "b@10", "a@3", "c/nested@0"):
        assert lite.resolve(ref) is not UNSURE, ref  # the forms a resume names are answered here
    assert lite.resolve("a@healthy") == index.resolve("a@1")  # both step 3s and step 2 are not
    assert lite.resolve("c/nested@healthy") is UNSURE  # never checked: the full index explains
    assert answered >= 20
    ids = sorted(c.chunk_id for c in index.all_chunks()) + ["0" * 64, "not-an-id"]
    chains = lite.chunk_locations(ids)
    assert chains == index.chunk_locations(ids)
    assert any(r.base_id is not None for r in chains.values())  # the deltas' bases are followed
    assert lite.chunk_locations(ids[:3]) == index.chunk_locations(ids[:3])
    assert lite.remote_pack_ids() == index.remote_pack_ids() != {}
    lite.close()
    assert lite.resolve("a") is UNSURE  # closed: the full index answers
    store.close()


def test_a_tag_named_like_a_run_is_left_to_the_full_index_which_names_both(tmp_path: Path) -> None:
    store, db = _history(tmp_path / "s")
    con = sqlite3.connect(db)
    with con:  # a store made before tags could not take a run's name
        con.execute("UPDATE tags SET name = 'b' WHERE name = 'best'")
    con.close()
    lite = LiteReads.open(str(db), store.repository.config.store_id)
    assert lite is not None and lite.resolve("b") is UNSURE
    with pytest.raises(ckstore.InvalidInputError, match="ambiguous"):
        store.get("b")
    lite.close()
    store.close()


@pytest.mark.parametrize(
    "harm", ["missing", "other store", "older schema", "no store id", "garbage"]
)
def test_an_index_lite_cannot_vouch_for_opens_the_full_way(tmp_path: Path, harm: str) -> None:
    store, db = _history(tmp_path / "s")
    store_id = store.repository.config.store_id
    store.close()
    if harm == "missing":
        db = tmp_path / "elsewhere.sqlite"
    elif harm == "other store":
        store_id = "0" * 32
    elif harm == "garbage":
        db.write_bytes(b"not a database" * 100)
        for end in ("-wal", "-shm"):
            Path(f"{db}{end}").unlink(missing_ok=True)
    else:
        con = sqlite3.connect(db)
        with con:
            if harm == "older schema":
                con.execute("UPDATE alembic_version SET version_num = '0007'")
            else:
                con.execute("DELETE FROM meta WHERE key = 'store_id'")
        con.close()
    assert LiteReads.open(str(db), store_id) is None
    if harm == "older schema":
        with pytest.raises(ckstore.SchemaError, match="ckstore migrate"):
            ckstore.open(tmp_path / "s")


def test_lite_knows_the_schema_it_reads() -> None:
    assert HEAD_REVISION == head_revision()


def test_a_damaged_row_is_reported_by_the_full_index(tmp_path: Path) -> None:
    store, db = _history(tmp_path / "s")
    store.close()
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE snapshots SET metadata = 'not json' WHERE run = 'b'")
    con.close()
    again = ckstore.open(tmp_path / "s")
    assert again.repository.reads._lite is not None  # noqa: SLF001 - the fast path is on
    with pytest.raises(IndexCorruptionError):
        again.get("b")
    with pytest.raises(SnapshotNotFoundError, match="Runs: a, b, c/nested"):
        again.get("nope")
    again.close()


def test_a_commit_after_the_open_is_seen(tmp_path: Path) -> None:
    store, _ = _history(tmp_path / "s")
    reader = ckstore.open(tmp_path / "s")
    assert reader.get("b").step == 10
    store.take({"m": ckstore.StateDict(_state(5))}, run="b", step=11)
    assert reader.get("b").step == 11
    assert reader.get("b@11").id == store.get("b").id
    reader.close()
    store.close()


def _resolve_in_child(lite: LiteReads, ref: str, out: Any) -> None:
    found = lite.resolve(ref)
    out.put(None if found is UNSURE else found.id)  # type: ignore[union-attr]


def test_a_child_forked_while_a_thread_reads_is_not_locked_out(tmp_path: Path) -> None:
    """A thread of the parent inside a read holds the lock at the fork: the child's reads
    must not wait for a thread it does not have."""
    store, db = _history(tmp_path / "s")
    lite = LiteReads.open(str(db), store.repository.config.store_id)
    assert lite is not None
    want = lite.resolve("best")
    held, release = threading.Event(), threading.Event()

    def reader() -> None:
        with lite._lock:  # noqa: SLF001 - a read in progress, held still
            held.set()
            release.wait(30)

    thread = threading.Thread(target=reader)
    thread.start()
    held.wait(30)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_resolve_in_child, args=(lite, "best", out), daemon=True)
    try:
        child.start()
        got = out.get(timeout=30)
        child.join(30)
    finally:
        release.set()
        thread.join()
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and got == want.id  # type: ignore[union-attr]
    lite.close()
    store.close()


def test_a_forked_child_reads_through_its_own_connection(tmp_path: Path) -> None:
    store, db = _history(tmp_path / "s")
    lite = LiteReads.open(str(db), store.repository.config.store_id)
    assert lite is not None
    want = lite.resolve("best")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_resolve_in_child, args=(lite, "best", out), daemon=True)
    child.start()
    got = out.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and got == want.id  # type: ignore[union-attr]
    assert lite.resolve("best") == want  # the parent's connection still serves it
    lite.close()
    store.close()


def test_a_fresh_process_resumes_without_sqlalchemy_and_still_takes(tmp_path: Path) -> None:
    """A resume (open, get, restore, close) reads the index through sqlite3 alone, and loads
    none of the verbs it does not use (remotes, gc, check, diff, compaction); whatever else the
    handle does opens the full index, and imports its verb's modules, on first use. Nor the
    index protocols (annotations only), the pack scanner, the backend wrappers or the health
    patterns (a take's)."""
    store = ckstore.open(tmp_path / "s", create=True, auto_compact=False)
    state = _state(0)
    for step in range(3):
        state["w"][step].add_(1.0)
        store.take(
            {"m": ckstore.StateDict(state)}, run="a", step=step, tags=["best"] if step == 1 else ()
        )
    store.compact(keep_loose=0)  # deltas: their bases are located too
    want = store.get("best").read_object("m/w")
    store.close()
    script = (
        "import sys, torch, ckstore\n"
        f"store = ckstore.open({str(tmp_path / 's')!r})\n"
        "state = {'w': torch.zeros(64, 256), 'b': torch.zeros(4096, dtype=torch.bfloat16)}\n"
        "store.get('best').restore({'m': ckstore.StateDict(state)})\n"
        "before = 'sqlalchemy' in sys.modules\n"
        "upkeep = ('ckstore.remote', 'ckstore.history.', 'ckstore.engine.take.commit',\n"
        "          'ckstore.engine.interfaces', 'ckstore.objects.pack_scan',\n"
        "          'ckstore.objects.wrappers', 'ckstore.format.health')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(upkeep) and 'defaults' not in m\n"
        "                and not m.endswith('auto_compact'))\n"
        "torch.save(state['w'], sys.argv[1])\n"
        "store.take({'m': ckstore.StateDict(state)}, run='a', step=7)\n"
        "print([before, loaded, 'sqlalchemy' in sys.modules, store.get('a').step])\n"
        "store.close()\n"
    )
    saved = tmp_path / "w.pt"
    out = subprocess.run(
        [sys.executable, "-c", script, str(saved)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    ).stdout
    # nor the maintenance and remote verbs' modules (116 -> 88 of ckstore's modules loaded; four
    # fewer since, without the protocols, the pack scanner, the wrappers and the health patterns)
    assert ast.literal_eval(out.strip().splitlines()[-1]) == [False, [], True, 7]
    assert torch.equal(torch.load(saved, weights_only=True), want)


def test_a_store_whose_path_holds_uri_characters_resumes_the_fast_way(tmp_path: Path) -> None:
    """The index file is opened through a ``file:`` URI (the lite reads, and the full index
    where the path holds ``?`` or ``%``): a folder named with ``?``, ``#``, ``%`` or a space
    must still name the store's own file, not another one outside it."""
    root = tmp_path / "a b%20c?mode=ro#x" / "store"
    with ckstore.open(root, create=True) as store:
        store.take({"m": ckstore.StateDict(_state(3))}, run="r", step=1)
    decoy = tmp_path / "a b c"  # what the percent-escape would decode to: must stay untouched
    decoy.mkdir()
    with ckstore.open(root) as store:
        snap = store.get("r@1")
        assert not store.repository.index_opened  # answered by the lite reads
        assert torch.equal(snap.read_object("m/w"), _state(3)["w"])
        assert store.log()[0].id == snap.id  # the full index: the same file
    with ckstore.open(root, read_only=True) as store:
        assert torch.equal(store.get("r").read_object("m/w"), _state(3)["w"])
    assert (root / "index.sqlite").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a b c", "a b%20c?mode=ro#x"]
    assert list(decoy.iterdir()) == []  # before: the index was made here, as a file


def test_the_advice_for_an_old_schema_names_the_stores_own_file(tmp_path: Path) -> None:
    """The URL a message gives (``ckstore migrate --index URL``) must name the store's index
    even where its path needs escaping; before, it named a file outside the store."""
    root = tmp_path / "m?x%41" / "store"
    with ckstore.open(root, create=True) as store:
        store.take({"m": ckstore.StateDict(_state(4))}, run="r", step=1)
    con = sqlite3.connect(root / "index.sqlite")
    with con:
        con.execute("UPDATE alembic_version SET version_num = '0007'")
    con.close()
    with pytest.raises(ckstore.SchemaError) as info:
        ckstore.open(root)
    url = str(info.value).split("ckstore migrate --index ", 1)[1].split()[0]
    engine = make_engine(url)  # what `ckstore migrate` opens: the store's file, at 0007
    try:
        assert current_revision(engine) == "0007"  # another (new, empty) file would say None
    finally:
        engine.dispose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m?x%41"]  # nothing made outside


@pytest.mark.parametrize("create", [False, True])
def test_an_index_left_outside_by_an_older_ckstore_is_named_not_replaced(
    tmp_path: Path, create: bool
) -> None:
    """Before the URL was escaped, the store ``.../p?q/store`` kept its index in the file
    ``.../p``. Opening it now must say so, not start an empty index that hides every
    snapshot (a resume with ``create=True`` would have begun again from step 0)."""
    root = tmp_path / "p?q" / "store"
    with ckstore.open(root, create=True) as store:
        store.take({"m": ckstore.StateDict(_state(5))}, run="r", step=7)
    legacy = tmp_path / "p"  # where the unescaped URL put it
    (root / "index.sqlite").rename(legacy)
    with pytest.raises(ckstore.ConflictError, match="outside it") as info:
        ckstore.open(root, create=create)
    assert str(legacy) in str(info.value)
    assert not (root / "index.sqlite").exists()  # nothing made in its place
    legacy.rename(root / "index.sqlite")  # what the message says to do
    with ckstore.open(root, create=create) as store:
        assert store.get("r").step == 7
