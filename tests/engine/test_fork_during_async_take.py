"""A child forked while an ``async_take`` is in flight (a ``multiprocessing`` worker with the
fork start method, a DataLoader worker, ``os.fork`` then ``sys.exit``) has none of its parent's
take threads. Before, it inherited the exit hook's list of takes in flight
(``ckstore/engine/take/inflight.py``) and waited at its exit for a future no thread of its
would ever complete: the child hung forever and ``Process.join()`` with it. Now the child
forgets them; the parent still waits for its take and commits it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import ckstore
from tests.support.forking import run_script

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, torch, ckstore
    from tests.support.forking import slow_puts, wait_child
    path, how = sys.argv[1], sys.argv[2]
    store = ckstore.open(path, create=True)
    state = {"m": ckstore.StateDict(w=torch.randn(64, 1024))}
    slow_puts(1.5)  # the take is still in flight at the fork
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
        print("CHILD", wait_child(pid), flush=True)
    print("STEP", pending.wait().step, flush=True)
    store.close()
    """
)


@pytest.mark.parametrize("how", ["process", "exit", "close"])
def test_a_child_forked_during_an_async_take_exits_and_the_parent_commits(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "store"
    proc = run_script(tmp_path, SCRIPT, str(path), how)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "CHILD 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "STEP 1" in proc.stdout
    with ckstore.open(path) as store:
        assert [s.step for s in store.log()] == [1]
        assert store.check(read_data=True).ok
