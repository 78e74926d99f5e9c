"""A child forked while an ``async_take`` of its parent holds a lease inherited the lease
module's list of leases held (``engine/lease.py``): after a take of its own, the child kept
ckstore's SIGTERM handler (the last lease out puts SIGTERM's default back, and the parent's
lease, never ended there, was counted forever), so a SIGTERM sent to it later raised
``Terminated`` inside whatever it ran instead of ending it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.forking import run_script

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, torch, ckstore
    from ckstore.objects import local
    from tests.support.forking import slow_puts
    store = ckstore.open(sys.argv[1], create=True)
    real = slow_puts(1.5)  # the take is still in flight at the fork
    pending = store.async_take({"m": ckstore.StateDict(w=torch.randn(64, 64))}, run="r", step=1)
    time.sleep(0.3)
    pid = os.fork()
    if pid == 0:
        local.LocalBackend.put = real
        store.take({"m": ckstore.StateDict(w=torch.randn(8, 8))}, run="c", step=1)
        os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 7)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
    print("STEP", pending.wait().step, flush=True)
    store.close()
    """
)


def test_a_child_forked_beside_an_async_take_gets_sigterms_default_back(tmp_path: Path) -> None:
    proc = run_script(tmp_path, SCRIPT, str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "CHILD 0" in proc.stdout, "the child kept ckstore's SIGTERM handler after its take"
    assert "STEP 1" in proc.stdout
