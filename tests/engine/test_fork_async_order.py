"""A child forked while its parent's ``async_take`` is in flight (a DataLoader or
``multiprocessing`` worker with the fork start method) that takes asynchronously on the
inherited handle: a handle's async takes commit in call order, each waiting for the one before
(``engine/take/single.py``, ``_in_call_order``). Before, the child's take waited for the
parent's, whose thread the child does not have: it never committed and ``wait()`` never
returned. Now the child's handle starts with no take before its own."""

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
    import os, sys, torch, ckstore
    from tests.support.forking import slow_puts
    store = ckstore.open(sys.argv[1], create=True)
    state = {"m": ckstore.StateDict(w=torch.randn(64, 1024))}
    store.take(state, run="r", step=1)
    slow_puts(1.5, only_pid=os.getpid())  # the parent's take is in flight at the fork
    pending = store.async_take(state, run="r", step=2)
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        try:
            mine = store.async_take({"m": ckstore.StateDict(w=torch.ones(8))}, run="c", step=1)
            ok = mine.wait(timeout=20).step == 1
        except BaseException as exc:
            print("CHILD", type(exc).__name__, exc, flush=True)
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
    print("PARENT", pending.wait().step, flush=True)
    store.close()
    """
)


def test_a_childs_async_take_does_not_wait_for_its_parents_in_flight_at_the_fork(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store"
    proc = run_script(tmp_path, SCRIPT, str(path))
    out = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert "CHILD 0" in proc.stdout and "PARENT 2" in proc.stdout, out
    with ckstore.open(path) as store:
        assert sorted((s.run, s.step) for s in store.log(run=None)) == [
            ("c", 1),
            ("r", 1),
            ("r", 2),
        ]
        assert store.check(read_data=True).ok
