"""A child forked while its parent's ``async_take`` is in flight (a DataLoader or
``multiprocessing`` worker with the fork start method) that takes asynchronously on the
inherited handle: a handle's async takes commit in call order, each waiting for the one before
(``engine/take/single.py``, ``_in_call_order``). Before, the child's take waited for the
parent's, whose thread the child does not have: it never committed and ``wait()`` never
returned. Now the child's handle starts with no take before its own."""

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
    import os, sys, time, torch, ckstore
    from ckstore.objects import local
    store = ckstore.open(sys.argv[1], create=True)
    state = {"m": ckstore.StateDict(w=torch.randn(64, 1024))}
    store.take(state, run="r", step=1)
    parent, real = os.getpid(), local.LocalBackend.put

    def slow(self, *a, **k):  # the parent's take is in flight at the fork
        if os.getpid() == parent:
            time.sleep(1.5)
        return real(self, *a, **k)

    local.LocalBackend.put = slow
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
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
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
