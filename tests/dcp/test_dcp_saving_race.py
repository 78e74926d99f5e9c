"""The retention of a save listed the live sessions before it listed the snapshots, so a save
beside it whose held session began, and whose snapshot committed, in between was taken for a
removed step (and deleted); it lists the snapshots first now."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckstore
from tests.dcp import folder_scenarios as fs


def test_a_save_committing_between_the_live_sessions_and_the_log_of_another_saves_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder_writer = importlib.import_module("ckstore.dcp.folder_writer")
    url, folder = fs.marked_titan(tmp_path)
    state = fs.step_state

    at_finish, go_finish = threading.Event(), threading.Event()
    committed, go_pointer = threading.Event(), threading.Event()
    real_holding, real_pointer = ckstore.Store.holding, folder_writer.write_pointer
    real_live = ckstore.Store.sessions
    saver2: list[threading.Thread] = []

    def holding(*a: Any, **k: Any) -> Any:  # save 2 reaches its finish: its take has begun
        if threading.current_thread() in saver2 and not at_finish.is_set():
            at_finish.set()
            assert go_finish.wait(30)
        return real_holding(*a, **k)

    def write_pointer(at: Any, pointer: Any) -> Any:
        if threading.current_thread() in saver2:
            committed.set()  # save 2: held session begun, saving file written, committed
            assert go_pointer.wait(30)
        return real_pointer(at, pointer)

    def live_sessions(self: Any, *a: Any, **k: Any) -> Any:
        got = real_live(self, *a, **k)
        if sys._getframe(1).f_code.co_name == "forget_removed" and not go_finish.is_set():
            go_finish.set()  # save 3's retention has its live sessions; save 2 goes on...
            assert committed.wait(30)  # ...through its commit, before save 3 lists snapshots
        return got

    monkeypatch.setattr(ckstore.Store, "holding", holding)
    monkeypatch.setattr(folder_writer, "write_pointer", write_pointer)
    monkeypatch.setattr(ckstore.Store, "sessions", live_sessions)
    errors: list[BaseException] = []

    def save2() -> None:
        try:
            dcp.save(state(2), checkpoint_id=os.path.join(folder, "step-2"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=save2)
    saver2.append(t)
    t.start()
    assert at_finish.wait(60)  # save 2's take began before save 3 does
    dcp.save(state(3), checkpoint_id=os.path.join(folder, "step-3"))
    go_pointer.set()
    go_finish.set()
    t.join(60)
    assert not errors, errors
    monkeypatch.setattr(ckstore.Store, "holding", real_holding)
    monkeypatch.setattr(folder_writer, "write_pointer", real_pointer)
    monkeypatch.setattr(ckstore.Store, "sessions", real_live)
    with ckstore.open(url) as store:
        assert sorted(int(s.step or 0) for s in store.log("titan")) == [1, 2, 3]
    out = {"w": torch.zeros(4096)}
    dcp.load(out, checkpoint_id=os.path.join(folder, "step-2"))
    assert torch.equal(out["w"], state(2)["w"])
