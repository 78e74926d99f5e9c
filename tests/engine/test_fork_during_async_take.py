"""A child forked while an ``async_take`` is in flight (a ``multiprocessing`` worker with the
fork start method, a DataLoader worker, ``os.fork`` then ``sys.exit``) has none of its parent's
take threads. Before, it inherited the exit hook's list of takes in flight
(``ckstore/engine/take/inflight.py``) and waited at its exit for a future no thread of its
would ever complete: the child hung forever and ``Process.join()`` with it. Now the child
forgets them; the parent still waits for its take and commits it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckstore
from tests.support.paths import REPO

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time, torch, ckstore
    from ckstore.objects import local
    path, how = sys.argv[1], sys.argv[2]
    store = ckstore.open(path, create=True)
    state = {"m": ckstore.StateDict(w=torch.randn(64, 1024))}
    real = local.LocalBackend.put

    def slow(self, *a, **k):  # the take is still in flight at the fork
        time.sleep(1.5)
        return real(self, *a, **k)

    local.LocalBackend.put = slow
    pending = store.async_take(state, run="r", step=1)
    if how == "process":
        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join(15)
        print("CHILD", "hung" if child.is_alive() else child.exitcode, flush=True)
        if child.is_alive():
            child.kill()
            child.join()
    else:
        pid = os.fork()
        if pid == 0:
            if how == "close":
                store.close()  # the child's own use of the inherited handle ends
            sys.exit(0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
            time.sleep(0.02)
        else:
            if time.monotonic() >= deadline:
                print("CHILD hung", flush=True)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        print("CHILD", "done", flush=True)
    print("STEP", pending.wait().step, flush=True)
    store.close()
    """
)


@pytest.mark.parametrize("how", ["process", "exit", "close"])
def test_a_child_forked_during_an_async_take_exits_and_the_parent_commits(
    tmp_path: Path, how: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(path), how],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "CHILD hung" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "CHILD 0" in proc.stdout or "CHILD done" in proc.stdout, proc.stdout
    assert "STEP 1" in proc.stdout
    with ckstore.open(path) as store:
        assert [s.step for s in store.log()] == [1]
        assert store.check(read_data=True).ok
