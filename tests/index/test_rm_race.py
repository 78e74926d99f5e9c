"""PostgreSQL: ``rm`` of a run's latest snapshot while a commit to the run chooses its parent.
The delete takes the run's row lock, as the commit does, so the new snapshot's parent is never
the deleted one. Before, the commit read r@2 as its head, the delete landed, and r@3 recorded
the deleted r@2 as its parent (the run no longer a chain)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.index import _commit
from tests.conftest import TINY
from tests.support.pgserver import PgServer

pytestmark = pytest.mark.postgres


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"s": ckstore.StateDict({"w": torch.randn(512, generator=g)})}


def test_a_delete_of_the_head_beside_a_commit_keeps_the_run_a_chain(
    tmp_path: Path, pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = pg.new_database()
    taker = ckstore.open(tmp_path / "store", index=index, create=True, **TINY)
    other = ckstore.open(tmp_path / "store", index=index, **TINY)  # another process's handle
    try:
        first = taker.take(_state(1), run="r", step=1)
        second = taker.take(_state(2), run="r", step=2)
        assert second.record.parent_id == first.id

        real = _commit.require_free  # runs after run_head chose the parent
        fired: list[bool] = []

        rm = threading.Thread(target=other.delete, args=(second.id,))

        def require_free(conn: Any, snapshot: Any) -> None:
            if not fired:
                fired.append(True)
                rm.start()  # `ckstore rm` elsewhere, one statement later
                rm.join(timeout=3.0)  # it finishes, unless it waits for this commit
            real(conn, snapshot)

        monkeypatch.setattr(_commit, "require_free", require_free)
        third = taker.take(_state(3), run="r", step=3)
        assert fired
        rm.join(timeout=60)
        assert not rm.is_alive()

        ids = {s.id for s in other.log(run="r")}
        assert ids == {first.id, third.id}
        parent = other.get(third.id).record.parent_id
        assert parent in ids, (
            f"snapshot r@3's parent is {parent}, the deleted r@2, not r@1 ({first.id})"
        )
    finally:
        other.close()
        taker.close()
