"""A child forked from a process that uses ckstore starts clean: it waits on no lock a thread
of its parent held at the fork, runs its own background work, never uses its parent's
connections, and never ends its parent's helper process.

Each case failed before its fix (the child hung, its job never ran, the child read through
the parent's SQLite connection, the parent's helper exited).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ckstore.distributed.take_async import background
from ckstore.engine.helper import Helper
from ckstore.index import Index
from ckstore.objects.fsspec_backend import FsspecBackend
from tests.support.forking import fork_and_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")


def test_a_put_in_flight_at_the_fork_does_not_hold_the_childs_puts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fs = fsspec.filesystem("memory")
    root = f"/fork-put-{os.getpid()}"
    parent = FsspecBackend(fs, root)
    real = FsspecBackend._write_parts
    started, release = threading.Event(), threading.Event()

    def slow(self: Any, path: str, views: Any) -> None:  # an upload of a pack: seconds
        if os.getpid() == pid_of_parent:
            started.set()
            release.wait(30)
        real(self, path, views)

    pid_of_parent = os.getpid()
    monkeypatch.setattr(FsspecBackend, "_write_parts", slow)
    putter = threading.Thread(target=parent.put, args=("packs/aa", b"x" * 10))
    putter.start()
    started.wait(5)

    def child() -> bool:
        mine = FsspecBackend(fs, root)  # a handle of its own on the same root
        mine.put("blobs/bb", b"y")
        return mine.get("blobs/bb") == b"y"

    try:
        assert fork_and_run(child, deadline_s=10) == "ok"
    finally:
        release.set()
        putter.join()


def test_the_async_distributed_takes_thread_of_a_child_is_its_own() -> None:
    assert background().submit(lambda: 1).result(timeout=10) == 1  # the parent's thread runs

    def child() -> bool:
        return bool(background().submit(lambda: 2).result(timeout=5) == 2)

    assert fork_and_run(child, deadline_s=15) == "ok"


def test_a_child_reads_the_index_through_connections_of_its_own(tmp_path: Path) -> None:
    """SQLite forbids using a connection across a fork; SQLAlchemy's pool would hand the
    child the parent's."""
    index = Index.open(f"sqlite:///{tmp_path / 'index.sqlite'}")
    try:

        def connection() -> int:
            with index._read("probe") as conn:  # noqa: SLF001 - the pool's connection
                return id(conn.connection.dbapi_connection)

        theirs = connection()
        read, write = os.pipe()

        def child() -> bool:
            os.write(write, b"same" if connection() == theirs else b"own")
            return index.list_runs() == []

        assert fork_and_run(child) == "ok"
        assert os.read(read, 16) == b"own"
        assert index.list_runs() == []  # the parent's connection still works
    finally:
        index.close()


class _Repo:
    url = "fork-test"


def test_a_child_that_uses_or_closes_an_inherited_helper_leaves_the_parents_running(
    tmp_path: Path,
) -> None:
    server = tmp_path / "echo_server.py"
    server.write_text(
        "import socket, sys\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "while s.recv(1 << 16):\n"
        "    pass\n"
    )
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    helper = Helper(_Repo(), "echo_server", "take", "retry")  # type: ignore[arg-type]
    try:
        helper.start()
        pid = helper.pid
        assert pid is not None

        def child() -> None:
            helper.start()  # what a take of the child does first: a helper of its own
            helper.close()

        assert fork_and_run(child) == "ok"
        time.sleep(0.5)
        assert helper.pid == pid  # the parent's helper still runs, on its socket
    finally:
        helper.close()
        os.environ["PYTHONPATH"] = os.environ["PYTHONPATH"].split(os.pathsep, 1)[1]


def test_the_gate_runs_its_wait_before_the_executors_and_loggings_fork_hooks() -> None:
    """A thread inside the gate that submits work or logs would otherwise wait for the fork
    that waits for it (their hooks hold their locks through the fork): in a process that
    imports ckstore's index before ``concurrent.futures.thread`` (no torch), a submit from
    inside the gate during a fork's wait returns at once."""
    script = (
        "import os, threading, time\n"
        "from ckstore.index import forks\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(1)\n"
        "took = []\n"
        "def inside():\n"
        "    with forks.sqlite_work():\n"
        "        time.sleep(0.3)\n"
        "        t = time.monotonic(); pool.submit(int).result(); took.append(time.monotonic() - t)\n"
        "t = threading.Thread(target=inside); t.start(); time.sleep(0.1)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0); t.join(); print(took[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert float(out.stdout.strip()) < 1.0
