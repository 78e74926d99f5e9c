"""A child forked from a process whose store pushes to a tier remote (``push_to``) closes
its inherited handle: it waited for the parent's push thread, which it does not have, forever."""

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
    from tests.support.forking import wait_child
    path, remote = sys.argv[1], sys.argv[2]
    store = ckstore.open(path, create=True, push_to=remote)
    store.take({"m": ckstore.StateDict(w=torch.randn(16, 16))}, run="r", step=1)
    pid = os.fork()
    if pid == 0:
        store.take({"m": ckstore.StateDict(w=torch.randn(8, 8))}, run="c", step=1)
        store.wait_pushed()  # returns (False): the child pushes nothing, its parent does
        store.close()  # the child's own use of the inherited handle ends
        os._exit(0)
    print("CHILD", wait_child(pid), flush=True)
    store.close()  # pushes what is pending, the child's snapshot too
    print("PARENT done", flush=True)
    """
)


def test_a_child_forked_beside_a_tier_push_closes_its_handle(tmp_path: Path) -> None:
    proc = run_script(tmp_path, SCRIPT, str(tmp_path / "local"), str(tmp_path / "remote"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "CHILD hung" not in proc.stdout and "PARENT done" in proc.stdout, proc.stdout
    with ckstore.open(tmp_path / "remote") as remote:
        assert sorted(s.run for s in remote.log(run=None)) == ["c", "r"]
