"""Processes a test started or watches."""

from __future__ import annotations

import os
import subprocess
import time


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists any more (exited and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in ``/proc`` is ``T``."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def wait_stopped(child: subprocess.Popen[str], within_s: float = 60.0) -> None:
    """Wait until ``child`` has stopped itself (it must not exit meanwhile)."""
    deadline = time.time() + within_s
    while not stopped(child.pid):
        assert time.time() < deadline and child.poll() is None, child.communicate()
        time.sleep(0.02)
