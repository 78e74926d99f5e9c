"""A child forked while an ``async_take`` of its parent holds a lease inherited the lease
module's list of leases held (``engine/lease.py``): after a take of its own, the child kept
ckstore's SIGTERM handler (the last lease out puts SIGTERM's default back, and the parent's
lease, never ended there, was counted forever), so a SIGTERM sent to it later raised
``Terminated`` inside whatever it ran instead of ending it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, torch, ckstore
    from ckstore.objects import local
    store = ckstore.open(sys.argv[1], create=True)
    real = local.LocalBackend.put

    def slow(self, *a, **k):  # the take is still in flight at the fork
        time.sleep(1.5)
        return real(self, *a, **k)

    local.LocalBackend.put = slow
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
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "CHILD 0" in proc.stdout, "the child kept ckstore's SIGTERM handler after its take"
    assert "STEP 1" in proc.stdout
