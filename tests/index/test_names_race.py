"""PostgreSQL: the name rules of ``_refnames`` hold between two handles whose transactions
overlap (READ COMMITTED lets each miss the other's uncommitted rows).

Each test lets another handle (another job, in a thread) act at the moment the first one's
commit has checked the names and not yet written: before the names lock (``_sql.names_lock``)
the other one went through unseen, so two takes both created tag "best" and one silently
moved it, and a tag and a run could both take one name (after which ``get("x")`` of the run
raised). Now the other waits for the first transaction, then sees its rows and is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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


class _Meanwhile:
    """Runs ``action`` in a thread once the first commit reaches ``lock_run`` (after its name
    checks), and gives it a few seconds there: time to finish unless it waits for a lock the
    first commit holds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any]) -> None:
        self.result: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(action,))
        real = _commit.lock_run

        def lock_run(conn: Any, run: str, now: float) -> None:
            if not self._thread.is_alive() and not self.result:
                self._thread.start()
                self._thread.join(timeout=3.0)
            real(conn, run, now)

        monkeypatch.setattr(_commit, "lock_run", lock_run)

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
    index = pg.new_database()
    mine = ckstore.open(tmp_path / "store", index=index, create=True, **TINY)
    theirs = ckstore.open(tmp_path / "store", index=index, **TINY)  # another job's handle
    try:
        other = _Meanwhile(
            monkeypatch, lambda: theirs.take(_state(2), run="b", step=1, tags=["best"])
        )
        first = _first_take(mine, _state(1), run="a", step=1, tags=["best"])
        monkeypatch.undo()
        second = other.outcome()
        outcomes = [first, second]
        won = [o for o in outcomes if not isinstance(o, ConflictError)]
        assert len(won) == 1, f"both takes created tag 'best': {outcomes}"
        assert theirs.tags()["best"] == won[0].id
    finally:
        theirs.close()
        mine.close()


def test_a_tag_and_the_first_take_of_a_run_of_its_name_never_both_succeed(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = pg.new_database()
    taker = ckstore.open(tmp_path / "store", index=index, create=True, **TINY)
    other = ckstore.open(tmp_path / "store", index=index, **TINY)  # another process's handle
    try:
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
    finally:
        other.close()
        taker.close()
