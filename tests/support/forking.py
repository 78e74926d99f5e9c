"""Fork this process, run a function in the child, and say how the child ended."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def fork_and_run(child: Callable[[], object], deadline_s: float = 10.0) -> str:
    """``"ok"`` (the child ran ``child`` and exited 0; a false return value counts as a
    failure), ``"failed"`` (it raised or returned false) or ``"hung"`` (still running at the
    deadline: killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = child() is not False
        except BaseException:  # noqa: BLE001 - reported by the exit code
            os._exit(1)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"
