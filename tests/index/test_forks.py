"""A process that forks while its threads work a store's index gives children whose SQLite works.

SQLite's process-wide mutexes (its allocator's) held by a thread at the fork stay held in the
child, where that thread does not exist: the child's first SQLite call waited forever (43 of
100 children here, and the two ranks of a torchtitan-style test forked right after a purge's gc
ran behind the previous test). ``ckstore/index/forks.py`` makes a fork wait until no thread is
inside SQLite.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.index import forks

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")


def _fork(child: Callable[[], None], deadline_s: float = 10.0) -> str:
    """Fork, run ``child`` there (exit 0 on success, 1 on an error); the child's fate."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException:  # noqa: BLE001 - reported by the exit code
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def _sqlite_in_child() -> None:
    con = sqlite3.connect(":memory:")
    con.execute("SELECT randomblob(100000)").fetchall()
    con.close()


def test_children_forked_while_threads_read_the_index_can_use_sqlite(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", chunk_bytes=1024, create=True) as store:
        for _ in range(3):
            store.take({"m": ckstore.StateDict(w=torch.randn(20_000))}, run="r")
    store = ckstore.open(tmp_path / "s")
    repo = store.repository
    missing = [f"{i:064x}" for i in range(300)]
    stop = threading.Event()

    def full_index() -> None:  # SQLAlchemy's connections, as a gc or a log
        while not stop.is_set():
            repo.index.list_snapshots()
            repo.index.chunk_locations(missing)

    def lite_reads() -> None:  # the standard library's, as a resume
        while not stop.is_set():
            repo.reads.resolve("r")
            repo.reads.chunk_locations(missing)

    threads = [
        threading.Thread(target=f, daemon=True) for f in (full_index, full_index, lite_reads)
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        fates = [_fork(_sqlite_in_child, deadline_s=5.0) for _ in range(40)]
    finally:
        stop.set()
        for t in threads:
            t.join()
        store.close()
    assert fates == ["ok"] * 40, f"{fates.count('hung')} of 40 children hung in SQLite"


def test_a_fork_waits_for_a_thread_inside_to_leave() -> None:
    events: list[str] = []
    inside = threading.Event()

    def worker() -> None:
        with forks.sqlite_work():
            inside.set()
            time.sleep(0.3)
            events.append("left")

    t = threading.Thread(target=worker)
    t.start()
    inside.wait()
    assert forks.others_inside() == [t.ident]
    assert _fork(lambda: None) == "ok"
    events.append("forked")
    t.join()
    assert events == ["left", "forked"]
    assert forks.others_inside() == []


def test_a_fork_from_inside_the_gate_neither_waits_for_itself_nor_leaves_the_child_stuck() -> None:
    def child() -> None:
        with forks.sqlite_work():  # nested in the block the parent forked in
            pass
        done = threading.Event()

        def other() -> None:  # another thread of the child gets in once we are out
            with forks.sqlite_work():
                done.set()

        t = threading.Thread(target=other)
        t.start()
        t.join(5)
        assert done.is_set()

    started = time.monotonic()
    with forks.sqlite_work():
        fate = _fork(child)
    assert fate == "ok"
    assert time.monotonic() - started < forks.FORK_WAIT_S  # did not wait for itself


def test_a_thread_that_never_leaves_delays_a_fork_only_so_long_and_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(forks, "FORK_WAIT_S", 0.3)
    release = threading.Event()
    inside = threading.Event()

    def stuck() -> None:
        with forks.sqlite_work():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=stuck, name="stuck-in-sqlite")
    t.start()
    inside.wait()
    try:
        with caplog.at_level(logging.WARNING, logger="ckstore"):
            started = time.monotonic()
            assert _fork(lambda: None) == "ok"
            waited = time.monotonic() - started
    finally:
        release.set()
        t.join()
    assert 0.25 < waited < 5
    assert "stuck-in-sqlite" in caplog.text and "may hang" in caplog.text
