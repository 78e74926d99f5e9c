"""A process that forks while its threads work a store's index gives children whose SQLite works.

SQLite's process-wide mutexes (its allocator's) held by a thread at the fork stay held in the
child, where that thread does not exist: the child's first SQLite call waited forever (43 of
100 children here, and the two ranks of a torchtitan-style test forked right after a purge's gc
ran behind the previous test). ``ckstore/index/forks.py`` makes a fork wait until no thread is
inside SQLite.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.index import forks
from tests.support.forking import fork_and_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")


@contextmanager
def _thread_inside(name: str = "inside") -> Iterator[threading.Event]:
    """A thread inside the gate until the block ends or the event it yields is set."""
    release, inside = threading.Event(), threading.Event()

    def stuck() -> None:
        with forks.sqlite_work():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=stuck, name=name)
    t.start()
    inside.wait()
    try:
        yield release
    finally:
        release.set()
        t.join()


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
        fates = [fork_and_run(_sqlite_in_child, deadline_s=5.0) for _ in range(40)]
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
    assert fork_and_run(lambda: None) == "ok"
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
        fate = fork_and_run(child)
    assert fate == "ok"
    assert time.monotonic() - started < forks.FORK_WAIT_S  # did not wait for itself


def test_a_thread_that_never_leaves_delays_a_fork_only_so_long_and_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(forks, "FORK_WAIT_S", 0.3)
    with _thread_inside("stuck-in-sqlite"), caplog.at_level(logging.WARNING, logger="ckstore"):
        started = time.monotonic()
        assert fork_and_run(lambda: None) == "ok"
        waited = time.monotonic() - started
    assert 0.25 < waited < 5
    assert "stuck-in-sqlite" in caplog.text and "may hang" in caplog.text


def test_two_threads_forking_at_once_keep_the_gate_closed_until_both_forks_are_done() -> None:
    """The fork hooks called as ``os.fork`` calls them: this thread forks from inside the gate
    while thread B's fork waits for it to leave. Once this fork is done, B's still is: a
    thread that comes meanwhile (C) must not enter until B's fork is done too."""
    b_forking = threading.Event()
    b_done = threading.Event()
    entered = threading.Event()

    def b() -> None:
        forks._before_fork()  # waits for this thread to leave the gate
        b_forking.set()
        b_done.wait(5)
        forks._after_fork_in_parent()

    def c() -> None:
        with forks.sqlite_work():
            entered.set()

    tb, tc = threading.Thread(target=b), threading.Thread(target=c)
    with forks.sqlite_work():
        tb.start()
        time.sleep(0.1)  # B waits in its hook
        forks._before_fork()  # a fork from inside: waits for no one
        forks._after_fork_in_parent()
        tc.start()
        assert not entered.wait(0.3)  # B's fork is still to come
    assert b_forking.wait(5)  # this thread left: B forks now
    assert not entered.wait(0.2)
    b_done.set()
    tb.join(5)
    assert entered.wait(5)
    tc.join(5)


def test_a_thread_a_fork_gave_up_on_delays_no_later_fork(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """N DataLoader workers forked while a lowered gc thread sits in a long transaction wait
    once, not N times: one fork gives up on it (its warning, once), the later ones do not wait
    for it (counted by the warnings, not by wall-clock time: a loaded machine forks slowly)."""
    monkeypatch.setattr(forks, "FORK_WAIT_S", 0.3)
    waits = []
    with caplog.at_level(logging.WARNING, logger="ckstore"), _thread_inside("long-transaction"):
        for _ in range(3):
            started = time.monotonic()
            assert fork_and_run(lambda: None) == "ok"
            waits.append(time.monotonic() - started)
    gave_up = [r for r in caplog.records if "still use the store's SQLite index" in r.message]
    assert waits[0] > 0.25 and len(gave_up) == 1, (waits, [r.message for r in gave_up])
    with _thread_inside() as release:  # once it left, its next transaction is waited for
        threading.Timer(0.2, release.set).start()
        started = time.monotonic()
        assert fork_and_run(lambda: None) == "ok"
        assert time.monotonic() - started > 0.15


def test_ctrl_c_during_the_wait_is_raised_again_after_the_fork() -> None:
    """A fork hook cannot raise (CPython prints and ignores it): an interrupt during the wait
    ends the wait and reaches the main thread once the fork is done."""
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        with _thread_inside():
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            started = time.monotonic()
            forks._before_fork()  # as os.fork runs it: interrupted after 0.2 s, not 10
            assert time.monotonic() - started < 2
            with pytest.raises(KeyboardInterrupt):
                forks._after_fork_in_parent()
                time.sleep(2)  # the interrupt arrives at the next check of the main thread
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with forks.sqlite_work():  # the gate is open again
        pass
