"""A training script whose last lines start the final checkpoint with ``async_take`` and then
end: falling off its end, ``sys.exit(0)``, or ``store.close()`` first. Before, the interpreter
stopped its thread pools before it joined the take's thread: the take failed, nothing was
committed, the exit code was 0 and nothing was printed. Now close and the exit wait for it
(``ckstore/engine/take/inflight.py``); a take that fails anyway is named on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckstore
from tests.support.paths import REPO

SCRIPT = textwrap.dedent(
    """
    import sys, torch, ckstore
    path, how = sys.argv[1], sys.argv[2]
    store = ckstore.open(path, chunk_bytes=1 << 16, pack_bytes=1 << 20, create=True)
    state = ckstore.StateDict(w=torch.randn(8 << 20), step=7)  # 32 MiB: still in flight below
    if how == "fail":
        import ckstore.engine.take.local as local

        def broken(*a, **k):
            raise OSError("injected: the disk went away")

        local.LocalTake.commit = broken
    pending = store.async_take({"m": state}, run="r", step=7)  # the final checkpoint
    if how == "close":
        store.close()
    if how in ("exit", "close", "fail"):
        sys.exit(0)
    """
)


def _run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(path), how],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return proc, path


@pytest.mark.parametrize("how", ["return", "exit", "close"])
def test_a_process_that_ends_during_an_async_take_commits_it(tmp_path: Path, how: str) -> None:
    proc, path = _run(tmp_path, how)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with ckstore.open(path) as store:
        snap = store.get("r@7")
        assert snap.read_object("m/step") == 7
        assert store.check(read_data=True).ok
    if how != "close":  # close waited already: nothing is left in flight at exit
        assert "waiting for 1 async take(s) in flight to commit" in proc.stderr
        assert "r@7" in proc.stderr


def test_an_async_take_that_fails_at_exit_is_named_on_stderr(tmp_path: Path) -> None:
    proc, path = _run(tmp_path, "fail")
    assert "the async take of r@7 failed and was not committed" in proc.stderr, proc.stderr
    assert "injected: the disk went away" in proc.stderr
    with ckstore.open(path) as store:
        assert store.get("r@7", None) is None
