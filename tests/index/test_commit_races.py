"""PostgreSQL: a commit and another handle's write whose transactions overlap (READ COMMITTED
lets each miss the other's uncommitted rows).

Each test lets another handle (another job, in a thread) act at a chosen point inside the
first handle's commit, and gives it a few seconds there: it finishes unless it waits for a lock
the commit holds.

- The name rules of ``_refnames``: before the names lock (``_sql.names_lock``) the other went
  through unseen, so two takes both created tag "best" and one silently moved it, and a tag and
  a run could both take one name (after which ``get("x")`` of the run raised).
- ``rm`` of a run's latest snapshot while a commit to the run chooses its parent: before the
  delete took the run's row lock, r@3 recorded the deleted r@2 as its parent.
- A take into a run that exists, with no tags, skips the names lock; the run's last snapshot
  deleted and a tag of its name set before the take locks the run made a tag and a run of one
  name. The take now reads the run's head under the run's row lock, which every delete of the
  run's snapshots takes first (also the order that keeps ``rm`` beside ``delete_run`` of the
  run from deadlocking, which taking it in ``delete_snapshot`` alone did).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import event
from sqlalchemy.engine import Engine

import ckstore
from ckstore.errors import CkstoreError, ConflictError
from ckstore.index import _commit
from tests.conftest import TINY
from tests.support.pgserver import PgServer

pytestmark = pytest.mark.postgres


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"s": ckstore.StateDict({"w": torch.randn(512, generator=g)})}


@contextmanager
def _two_handles(tmp_path: Path, pg: PgServer) -> Iterator[tuple[ckstore.Store, ckstore.Store]]:
    """Two handles on one store and PostgreSQL index: this job's, and another job's."""
    index = pg.new_database()
    mine = ckstore.open(tmp_path / "store", index=index, create=True, **TINY)
    theirs = ckstore.open(tmp_path / "store", index=index, **TINY)
    try:
        yield mine, theirs
    finally:
        theirs.close()
        mine.close()


class _Meanwhile:
    """Runs ``action`` in a thread once the first commit reaches ``_commit.<at>``."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any], at: str = "lock_run"
    ) -> None:
        self.result: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(action,))
        real = getattr(_commit, at)

        def hook(*args: Any) -> Any:
            if not self._thread.is_alive() and not self.result:
                self._thread.start()
                self._thread.join(timeout=3.0)
            return real(*args)

        monkeypatch.setattr(_commit, at, hook)

    def _run(self, action: Callable[[], Any]) -> None:
        try:
            self.result.append(action())
        except ConflictError as exc:
            self.result.append(exc)

    def outcome(self) -> Any:
        self._thread.join(timeout=60)
        assert not self._thread.is_alive() and self.result
        return self.result[0]


def _first_take(store: ckstore.Store, *args: Any, **kwargs: Any) -> Any:
    try:
        return store.take(*args, **kwargs)
    except ConflictError as exc:
        return exc


def test_two_takes_creating_one_tag_never_both_succeed(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _two_handles(tmp_path, pg) as (mine, theirs):
        other = _Meanwhile(
            monkeypatch, lambda: theirs.take(_state(2), run="b", step=1, tags=["best"])
        )
        first = _first_take(mine, _state(1), run="a", step=1, tags=["best"])
        monkeypatch.undo()
        outcomes = [first, other.outcome()]
        won = [o for o in outcomes if not isinstance(o, ConflictError)]
        assert len(won) == 1, f"both takes created tag 'best': {outcomes}"
        assert theirs.tags()["best"] == won[0].id


def test_a_tag_and_the_first_take_of_a_run_of_its_name_never_both_succeed(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _two_handles(tmp_path, pg) as (taker, other):
        old = taker.take(_state(1), run="r", step=1)
        tagging = _Meanwhile(monkeypatch, lambda: other.tag(old.id, "x"))  # `ckstore tag r@1 x`
        new = _first_take(taker, _state(2), run="x", step=2)
        monkeypatch.undo()
        tagged = tagging.outcome()
        assert isinstance(new, ConflictError) or isinstance(tagged, ConflictError), (
            "a tag and a run both named 'x'"
        )
        if not isinstance(new, ConflictError):
            assert other.get("x").id == new.id  # the take succeeded: its run's name opens it


def test_a_delete_of_the_head_beside_a_commit_keeps_the_run_a_chain(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _two_handles(tmp_path, pg) as (taker, other):
        first = taker.take(_state(1), run="r", step=1)
        second = taker.take(_state(2), run="r", step=2)
        assert second.record.parent_id == first.id
        # `ckstore rm r@2` elsewhere, once the commit chose its parent (run_head)
        rm = _Meanwhile(monkeypatch, lambda: other.delete(second.id), at="require_free")
        third = taker.take(_state(3), run="r", step=3)
        monkeypatch.undo()
        rm.outcome()
        ids = {s.id for s in other.log(run="r")}
        assert ids == {first.id, third.id}
        parent = other.get(third.id).record.parent_id
        assert parent in ids, f"r@3's parent is {parent}, the deleted r@2, not r@1 ({first.id})"


@pytest.mark.parametrize("how", ["rm", "delete_run"])
def test_a_take_into_a_run_emptied_and_tagged_meanwhile_keeps_one_meaning(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    with _two_handles(tmp_path, pg) as (taker, other):
        old = taker.take(_state(1), run="foo", step=1)
        elsewhere = taker.take(_state(2), run="bar", step=1)

        def empty_and_tag() -> None:
            if how == "rm":
                other.delete(old.id, force=True)
            else:
                other.delete_run("foo", force=True)
            other.tag(elsewhere.id, "foo")  # `ckstore tag bar@1 foo`: run foo is empty now

        meanwhile = _Meanwhile(monkeypatch, empty_and_tag)
        new = _first_take(taker, _state(3), run="foo", step=2)
        monkeypatch.undo()
        meanwhile.outcome()
        tagged = "foo" in other.tags()
        assert not (tagged and any(True for _ in other.log(run="foo"))), (
            f"tag 'foo' and run 'foo' (with snapshot {getattr(new, 'id', new)}) both exist"
        )


def test_rm_beside_delete_run_does_not_deadlock(tmp_path: Path, pg: PgServer) -> None:
    with _two_handles(tmp_path, pg) as (mine, other):
        mine.take(_state(1), run="r", step=1)
        second = mine.take(_state(2), run="r", step=2)
        main = threading.current_thread()
        results: list[Any] = []

        def drop_run() -> None:
            try:
                results.append(other.delete_run("r", force=True))
            except CkstoreError as exc:
                results.append(exc)

        thread = threading.Thread(target=drop_run)

        def hook(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if (
                threading.current_thread() is main
                and not thread.ident
                and "FROM runs" in statement
                and "FOR UPDATE" in statement
            ):
                thread.start()  # `ckstore rm --run r` elsewhere, right after rm locked the run
                thread.join(timeout=3.0)

        event.listen(Engine, "after_cursor_execute", hook)
        try:
            try:
                mine.delete(second.id, force=True)
                rm: Any = None
            except CkstoreError as exc:
                rm = exc
        finally:
            event.remove(Engine, "after_cursor_execute", hook)
        thread.join(timeout=60)
        assert thread.ident and not thread.is_alive()
        for outcome in (rm, *results):
            assert "deadlock" not in str(outcome), f"{type(outcome).__name__}: {outcome}"
