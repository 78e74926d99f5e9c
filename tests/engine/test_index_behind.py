"""The full index a resume's open left for later (``index/lite.py``) is opened behind the
restore of a training job, on a thread of normal priority: never behind training's lowered
threads (a foreground call would wait for it behind every busy core), never left open by a
close that came first, and never half-opened in a forked child."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.index import Index

KNOBS = {"chunk_bytes": 16 << 10, "pack_bytes": 256 << 10, "inline_bytes": 64}


def _app(fill: float) -> dict[str, Any]:
    w = torch.full((64, 64), fill)
    optim = {"state": {0: {"exp_avg": torch.full((64, 64), fill)}}, "param_groups": [{"lr": 0.1}]}
    return {"m": ckstore.StateDict({"w": w}), "o": ckstore.StateDict(optim)}


def _saved(path: Path) -> None:
    with ckstore.open(path, create=True, **KNOBS) as store:
        store.async_take(_app(1.0), run="r", step=1).wait(timeout=60)


def _opened_within(store: ckstore.Store, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not store.repository.index_opened and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.repository.index_opened


def _slow_open(monkeypatch: pytest.MonkeyPatch, seconds: float, seen: list[Any]) -> None:
    real = Index.open.__func__  # type: ignore[attr-defined]

    def slow(cls: type[Index], *args: Any, **kwargs: Any) -> Index:
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0)))
        time.sleep(seconds)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Index, "open", classmethod(slow))


def test_a_training_jobs_restore_opens_the_index_behind_it_at_normal_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path / "s")
    seen: list[Any] = []
    _slow_open(monkeypatch, 0.0, seen)
    with ckstore.open(tmp_path / "s") as store:
        assert not store.repository.index_opened  # the resume reads through sqlite3
        store.get("r").restore(_app(0.0))
        assert _opened_within(store, 30)
        prepared = store.repository.staging_prepared
        assert prepared is not None and prepared.result(timeout=60) > 0
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == [("ckstore-open-index", mine)]  # before: the preparation's thread, at nice 19
    with ckstore.open(tmp_path / "s") as store:  # weights alone: nothing readied, nothing opened
        store.get("r").restore({"m": ckstore.StateDict({"w": torch.zeros(64, 64)})})
        time.sleep(0.2)
        assert not store.repository.index_opened


def test_a_close_right_after_the_restore_leaves_no_index_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path / "s")
    _slow_open(monkeypatch, 0.3, [])
    store = ckstore.open(tmp_path / "s")
    store.get("r").restore(_app(0.0))
    store.close()  # while the index opens behind: the close waits, then closes it
    time.sleep(0.5)
    db = str(tmp_path / "s" / "index.sqlite")
    assert not [f for f in _open_files() if f.startswith(db)]  # before: index.sqlite, -wal, -shm


def _open_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def _child_uses_the_index(store: ckstore.Store, out: Any) -> None:
    out.put(store.repository.index_opened)
    store.repository.index  # noqa: B018 - a lock held by a thread the child lacks would hang here
    out.put("done")


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="fork hooks are POSIX")
def test_a_fork_while_the_index_opens_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data loader's workers are forked right after a resume: a child must not inherit the
    opening's lock (or a module import) held by a thread it does not have."""
    _saved(tmp_path / "s")
    _slow_open(monkeypatch, 0.5, [])
    with ckstore.open(tmp_path / "s") as store:
        store.get("r").restore(_app(0.0))
        time.sleep(0.1)  # the opening holds its lock now
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_uses_the_index, args=(store, out), daemon=True)
        child.start()
        try:
            got = [out.get(timeout=30), out.get(timeout=30)]
            child.join(30)
        finally:
            if child.is_alive():  # hung (before: on the lock of the opening thread)
                child.kill()
        assert child.exitcode == 0 and got == [True, "done"]
