"""``overwrite=False``: what a caller of ``dcp.save`` catches when the target exists.

DCP wraps every storage error in its ``CheckpointException`` (a BaseException, which
``except Exception`` does not catch); the writer's ConflictError is its failure on the rank,
both when the save starts and when another save committed the target while this one wrote.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ckstore
from ckstore.dcp import StorageWriter
from ckstore.errors import ConflictError


def _save(store: ckstore.Store, writer: StorageWriter) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(64.0)}, storage_writer=writer, no_dist=True)


def _conflict(info: pytest.ExceptionInfo[Any]) -> BaseException:
    failures = info.value.failures
    assert list(failures) == [0]
    return failures[0][0]


def test_an_existing_target_raises_checkpoint_exception_carrying_conflict_error(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "s", create=True)
    _save(store, StorageWriter(store, run="o", step=1, overwrite=False))
    with pytest.raises(CheckpointException) as info:
        _save(store, StorageWriter(store, run="o", step=1, overwrite=False))
    assert isinstance(_conflict(info), ConflictError) and "'o@1' already exists" in str(
        _conflict(info)
    )
    assert [s.step for s in store.log("o")] == [1]
    store.close()


def test_a_target_committed_during_the_save_is_refused_at_finish(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True)

    class Racing(StorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)
            store.take({"x": ckstore.StateDict(a=1)}, run="o", step=1)  # another save wins
            return done

    with pytest.raises(CheckpointException) as info:
        _save(store, Racing(store, run="o", step=1, overwrite=False))
    assert isinstance(_conflict(info), ConflictError)
    assert len(store.log("o")) == 1  # only the racing take committed
    assert not store.repository.index.live_sessions()  # the refused save's session ended
    store.close()
