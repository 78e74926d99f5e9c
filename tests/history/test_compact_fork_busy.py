"""A child forked while its parent takes (an ``async_take`` in flight, a DataLoader worker
forked beside it) and then takes on the inherited handle itself: its background compaction
waits while a take or restore *of its process* runs (``Repository.busy``). Before, the child
inherited the parent's count of takes running at the fork, whose threads it does not have:
its compaction waited forever, and ``compact()`` and ``wait_compacted()`` with it. Now a child
counts its own."""

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
    import faulthandler, os, sys, time, torch, ckstore
    from tests.support.forking import slow_puts
    store = ckstore.open(sys.argv[1], create=True, chunk_bytes=1 << 12)
    state = {"m": ckstore.StateDict(w=torch.randn(64, 1024))}
    store.take(state, run="r", step=1)
    store.wait_compacted()
    slow_puts(1.5, only_pid=os.getpid())  # the parent's take is in flight at the fork
    pending = store.async_take(state, run="r", step=2)
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        faulthandler.dump_traceback_later(30, exit=True)  # a hung child exits 1
        try:
            for step in (1, 2, 3):
                w = torch.randn(1 << 16)
                store.take({"m": ckstore.StateDict(w=w)}, run="c", step=step)
            store.compact()  # waits for the compaction behind the takes, then compacts
            ok = store.wait_compacted(timeout=20)
            print("CHILD compacted", ok, flush=True)
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


def test_a_childs_compaction_does_not_wait_for_its_parents_takes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    proc = run_script(tmp_path, SCRIPT, str(path), env={"CKSTORE_AUTO_COMPACT": "1"})  # the default
    out = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert "CHILD compacted True" in proc.stdout and "CHILD 0" in proc.stdout, out
    assert "PARENT 2" in proc.stdout, out
    with ckstore.open(path) as store:
        assert sorted((s.run, s.step) for s in store.log(run=None)) == [
            ("c", 1),
            ("c", 2),
            ("c", 3),
            ("r", 1),
            ("r", 2),
        ]
        assert store.check(read_data=True).ok
