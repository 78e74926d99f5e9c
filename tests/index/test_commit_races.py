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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import ConflictError
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
