"""The remote a two-tier store pushes to goes away, or lies: nothing committed is lost.

- A remote once used is never created anew (docs/RELIABILITY.md, I7): with its folder taken
  away (an unmounted share leaves an empty mount point), or its index taken away, pushes fail,
  snapshots stay ``pushing``, nothing is evicted and nothing is written there; once it is back,
  the uploader sends what waited. Another store at its URL is refused.
- Eviction needs proof, not the remote index's word: with the remote's packs taken away (its
  index intact), or its index rolled back to before some acknowledged commits (a PostgreSQL
  replica promoted), the local tier keeps its copies; snapshots the remote lost are pushed
  again.

The kill tests run a training process (takes, the uploader, a local budget of 0: evict all it
can) against the remote with one of its parts taken away, SIGKILL it, and check what is left:
on a local folder and on S3 (moto, the remote's index an SQLite file beside it).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore import errors
from ckstore.remote import uploader as uploader_mod
from tests.support.remotes import KNOBS, fill, restores


@dataclass
class Remote:
    """Where the tier remote lives and how to take a part of it away and bring it back."""

    kind: str
    url: str
    index: str | None
    options: dict[str, Any] | None
    root: Path  # local: the folder; s3: where the index file is
    fs: Any = None
    away: list[tuple[str, str, bool]] = field(default_factory=list)
    parts: set[str] = field(default_factory=set)

    def open_kw(self) -> dict[str, Any]:
        return {"push_to": self.url, "remote_index": self.index, "remote_options": self.options}

    def open(self) -> ckstore.Store:
        return ckstore.open(self.url, index=self.index, storage_options=self.options)

    # --- parts of the remote ---------------------------------------------------------------
    def _index_file(self) -> Path:
        return self.root / "index.sqlite" if self.kind == "local" else self.root / "remote.sqlite"

    def take_away(self, part: str) -> None:
        """Take the remote's ``folder``, ``packs`` or ``index`` away (to bring it back later)."""
        self.parts.add(part)
        if part == "index":
            for suffix in ("", "-wal", "-shm"):
                f = Path(f"{self._index_file()}{suffix}")
                if f.exists():
                    self._move(str(f), f"{f}.away")
            return
        if self.kind == "local":
            where = self.root if part == "folder" else self.root / "packs"
            self._move(str(where), f"{where}.away")
            if part == "folder":
                where.mkdir()  # the mount point stays, empty
            return
        prefix = self.url[len("s3://") :] + ("/packs" if part == "packs" else "")
        self._move(prefix, f"{prefix}-away-{uuid.uuid4().hex[:6]}", s3=True)

    def bring_back(self) -> None:
        for src, dst, s3 in reversed(self.away):
            if s3:
                self._s3_move(dst, src)
            else:
                if Path(src).is_dir() and not any(Path(src).iterdir()):
                    Path(src).rmdir()  # the empty mount point is covered again
                os.rename(dst, src)
        self.away.clear()
        self.parts.clear()

    def _move(self, src: str, dst: str, s3: bool = False) -> None:
        if s3:
            self._s3_move(src, dst)
        else:
            os.rename(src, dst)
        self.away.append((src, dst, s3))

    def _s3_move(self, src: str, dst: str) -> None:
        """Move every object under the prefix ``src`` to ``dst`` (object by object)."""
        for key in self.fs.find(src):
            self.fs.copy(key, dst + key[len(src) :])
            self.fs.rm(key)
        self.fs.invalidate_cache()

    def holds_a_new_store(self) -> bool:
        """Whether something made a store, or an index, where the folder or index was taken
        away (new packs where only the packs were taken away are fair)."""
        if "folder" in self.parts:
            if self.kind == "local":
                return self.root.is_dir() and any(self.root.iterdir())  # the mount point
            return bool(self.fs.exists(self.url[len("s3://") :] + "/ckstore.json"))
        if "index" in self.parts:
            index = self._index_file()
            return index.exists() and _has_tables(index)
        return False


def _has_tables(path: Path) -> bool:
    with sqlite3.connect(path) as conn:
        return bool(conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    if request.param == "local":
        yield Remote("local", str(tmp_path / "share"), None, None, tmp_path / "share")
        return
    import s3fs

    server = request.getfixturevalue("s3_server")
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(**server.storage_options())
    yield Remote(
        "s3",
        f"s3://{bucket}/tier",
        f"sqlite:///{tmp_path / 'remote.sqlite'}",
        server.remote_options(),
        tmp_path,
        fs,
    )


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uploader_mod, "RETRY_SECONDS", (0.05, 0.2))
    monkeypatch.setattr(uploader_mod, "CLOSE_ATTEMPTS", 1)


def _pushed_everything(tmp_path: Path, remote: Remote, steps: list[int]) -> None:
    """The local store at ``tmp_path / 'local'`` with ``steps`` of run r, all pushed (no budget)."""
    with ckstore.open(
        tmp_path / "local", create=True, auto_compact=False, **remote.open_kw(), **KNOBS
    ) as s:
        fill(s, "r", steps)
        assert s.wait_pushed(timeout=60)


# --- a remote missing for a while ------------------------------------------------------------
@pytest.mark.parametrize("part", ["folder", "index"])
def test_a_tier_remote_missing_for_a_while_is_never_made_anew(tmp_path, remote, part) -> None:
    _pushed_everything(tmp_path, remote, [1, 2])
    remote.take_away(part)
    with ckstore.open(
        tmp_path / "local", local_budget=0, auto_compact=False, **remote.open_kw()
    ) as store:
        fill(store, "r", [3, 4])
        with pytest.raises((errors.NotFoundError, errors.StorageError)) as err:
            store.wait_pushed(timeout=60)
        assert (
            "missing" in str(err.value) or "gone" in str(err.value) or "no index" in str(err.value)
        )
        assert {s.state for s in store.push_status().values()} == {"pushing", "pushed"}
        pushing = {sid for sid, s in store.push_status().items() if s.state == "pushing"}
        assert pushing == {store.get("r@3").id, store.get("r@4").id}
        assert store.repository.index.remote_pack_ids() == {}  # nothing evicted
        report = store.check()  # a read command never creates the remote either
        assert report.ok, report.problems
        assert not remote.holds_a_new_store()
    remote.bring_back()
    with ckstore.open(
        tmp_path / "local", local_budget=0, auto_compact=False, **remote.open_kw()
    ) as store:
        assert store.wait_pushed(timeout=60)
        assert {s.state for s in store.push_status().values()} == {"pushed"}
        assert all(restores(store, f"r@{i}", i) for i in (1, 2, 3, 4))
    with remote.open() as there:
        assert (
            all(restores(there, f"r@{i}", i) for i in (1, 2, 3, 4))
            and there.check(read_data=True).ok
        )


def test_another_store_at_the_remote_url_is_refused(tmp_path) -> None:
    """A different share mounted at the remote's path (the id check is the same for every
    backend: one layout is enough)."""
    remote = Remote("local", str(tmp_path / "share"), None, None, tmp_path / "share")
    _pushed_everything(tmp_path, remote, [1])
    os.rename(remote.root, f"{remote.root}.old")
    ckstore.open(remote.root, create=True, **KNOBS).close()  # a different share mounted there
    with ckstore.open(tmp_path / "local", auto_compact=False, **remote.open_kw()) as store:
        fill(store, "r", [2])
        with pytest.raises(errors.ConflictError, match="another store"):
            store.wait_pushed(timeout=60)
        assert store.push_status()[store.get("r@2").id].state == "pushing"
        with pytest.raises(errors.ConflictError, match="another store"):
            store.push("tier")
    with ckstore.open(remote.root) as other:
        assert other.log() == []


def test_a_push_to_a_remote_whose_store_is_gone_creates_nothing(tmp_path, source) -> None:
    source.add_remote("backup", tmp_path / "backup")
    assert source.push("backup").created
    shutil.rmtree(tmp_path / "backup")
    (tmp_path / "backup").mkdir()
    with pytest.raises(errors.NotFoundError, match="missing"):
        source.push("backup")
    with pytest.raises(errors.NotFoundError, match="missing"):
        source.pull("backup")
    assert list((tmp_path / "backup").iterdir()) == []


def test_a_remote_added_where_a_store_is_records_its_id(tmp_path, source) -> None:
    with ckstore.open(tmp_path / "there", create=True) as there:
        want = there.repository.config.store_id
    rec = source.add_remote("there", tmp_path / "there")
    assert rec.store_id == want
    source.add_remote("later", tmp_path / "later")
    assert source.repository.index.get_remote("later").store_id is None  # type: ignore[union-attr]
    source.push("later")  # the first push creates it and records its id
    with ckstore.open(tmp_path / "later") as later:
        got = source.repository.index.get_remote("later")
        assert got is not None and got.store_id == later.repository.config.store_id


# --- eviction needs proof ---------------------------------------------------------------------
def test_eviction_keeps_what_the_remote_lost_its_packs_of(tmp_path, remote) -> None:
    _pushed_everything(tmp_path, remote, [1, 2, 3])
    remote.take_away("packs")  # its index still names them
    with ckstore.open(
        tmp_path / "local", local_budget=0, auto_compact=False, **remote.open_kw()
    ) as store:
        fill(store, "r", [4])
        assert store.wait_pushed(timeout=60)
        ev = store.last_eviction
        assert ev is not None and ev.packs_kept > 0
        assert all(restores(store, f"r@{i}", i) for i in (1, 2, 3, 4))
    remote.away.clear()  # the packs are gone for good
    with ckstore.open(tmp_path / "local") as store:
        assert all(restores(store, f"r@{i}", i) for i in (1, 2, 3, 4))
        assert store.check(read_data=True).ok


def test_snapshots_a_rolled_back_remote_index_lost_are_pushed_again(tmp_path) -> None:
    """The remote's index is put back to a copy from before r@3 was pushed (acknowledged
    commits lost: an asynchronous replica promoted). The local tier keeps r@3's packs, forgets
    that the remote holds it, and pushes it again."""
    share = tmp_path / "share"
    kw = {"push_to": str(share), "auto_compact": False}
    with ckstore.open(tmp_path / "local", create=True, **kw, **KNOBS) as s:
        fill(s, "r", [1, 2])
        assert s.wait_pushed(timeout=60)
    shutil.copyfile(share / "index.sqlite", tmp_path / "index-before.sqlite")
    with ckstore.open(tmp_path / "local", **kw) as s:
        fill(s, "r", [3])
        assert s.wait_pushed(timeout=60)
    shutil.copyfile(tmp_path / "index-before.sqlite", share / "index.sqlite")
    with ckstore.open(share) as there:
        assert [x.step for x in there.log()] == [2, 1]
    with ckstore.open(tmp_path / "local", local_budget=0, **kw) as s:
        assert s.wait_pushed(timeout=60)
        assert all(restores(s, f"r@{i}", i) for i in (1, 2, 3))
    with ckstore.open(share) as there:
        assert sorted(x.step for x in there.log()) == [1, 2, 3]
        assert (
            all(restores(there, f"r@{i}", i) for i in (1, 2, 3)) and there.check(read_data=True).ok
        )
    with ckstore.open(tmp_path / "local") as s:
        assert all(restores(s, f"r@{i}", i) for i in (1, 2, 3))


# --- kill tests: a training process against a remote with a part taken away --------------------
def _training(local: str, open_kw: dict[str, Any], steps: list[int]) -> None:
    """Take ``steps`` with the uploader and a budget of 0, wait for the pushes (or their
    failure), then die without closing (SIGKILL: no clean close, no final push)."""
    uploader_mod.RETRY_SECONDS = (0.05,)
    store = ckstore.open(local, local_budget=0, auto_compact=False, **open_kw)
    fill(store, "r", steps)
    try:
        store.wait_pushed(timeout=60)
    except errors.CkstoreError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _killed(tmp_path: Path, remote: Remote, steps: list[int]) -> None:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_training, args=(str(tmp_path / "local"), remote.open_kw(), steps))
    proc.start()
    proc.join(180)
    assert proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("part", ["folder", "packs", "index"])
def test_a_training_process_killed_with_a_part_of_its_remote_taken_away(
    tmp_path, remote, part
) -> None:
    _pushed_everything(tmp_path, remote, [1, 2, 3])
    remote.take_away(part)
    _killed(tmp_path, remote, [4, 5])
    assert not remote.holds_a_new_store()
    with ckstore.open(tmp_path / "local") as store:  # everything committed is still readable
        assert [s.step for s in store.log()] == [5, 4, 3, 2, 1]
        assert all(restores(store, f"r@{i}", i) for i in range(1, 6))
        states = {store.get(f"r@{i}").id: i for i in range(1, 6)}
        pushing = {states[sid] for sid, st in store.push_status().items() if st.state == "pushing"}
        if part != "packs":
            assert pushing == {4, 5}  # never counted as pushed to a stand-in
    if part == "packs":
        remote.away.clear()  # gone for good: what stayed local is what restores
        return
    remote.bring_back()
    with ckstore.open(tmp_path / "local", auto_compact=False, **remote.open_kw()) as store:
        assert store.wait_pushed(timeout=60)
    with remote.open() as there:
        assert (
            all(restores(there, f"r@{i}", i) for i in range(1, 6))
            and there.check(read_data=True).ok
        )
