"""Fork this process, run a function in the child, and say how the child ended; and the
pieces of the tests whose script forks beside a take in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


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


def slow_puts(seconds: float, only_pid: int | None = None) -> Callable[..., object]:
    """Make every object put of a local store take ``seconds`` longer (only in process
    ``only_pid`` when given), so that a take is still in flight when a test forks; returns
    the real ``LocalBackend.put`` (a child puts it back to write at full speed)."""
    from ckstore.objects import local

    real = local.LocalBackend.put

    def slow(self: object, *args: object, **kwargs: object) -> object:
        if only_pid is None or os.getpid() == only_pid:
            time.sleep(seconds)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    local.LocalBackend.put = slow  # type: ignore[method-assign]
    return real


def wait_child(pid: int, deadline_s: float = 15.0) -> str:
    """Wait for the forked child ``pid``: ``"hung"`` if it still runs at the deadline (then
    killed), else its exit code as text."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def run_script(
    folder: Path, script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Write ``script`` to ``folder/train.py`` and run it in a fresh interpreter that imports
    this repository (``tests.support`` too), with ``args``; its output captured."""
    from tests.support.paths import REPO

    path = folder / "train.py"
    path.write_text(script)
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        check=False,
    )
