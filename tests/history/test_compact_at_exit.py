"""A script that ends while the background compaction runs: quiet, and nothing lost.

``dcp.save(checkpoint_id="ckstore://...")`` opens its store by URL and nothing closes it, so
the interpreter exits with the compaction the saves kicked still running; the thread pools
refuse new work then. That stop is a crash by another name (the chunks stay loose, every
snapshot reads back), and was reported on the way out as a failed compaction, once per retry.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.engine import lease
from ckstore.errors import LeaseExpiredError
from ckstore.history.auto_compact import AutoCompactor

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckstore
    import torch.distributed.checkpoint as dcp

    for step in range(1, 7):
        g = torch.Generator().manual_seed(step)
        state = {"w%d" % i: torch.randn(2**19, generator=g) for i in range(8)}
        dcp.save(state, checkpoint_id=f"ckstore://{sys.argv[1]}/titan@{step}")
    print("saved")
    """
)


def test_a_script_that_exits_mid_compaction_says_nothing_and_loses_nothing(tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    env = {
        **os.environ,
        "CKSTORE_AUTO_COMPACT": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    for _ in range(2):  # the compaction's progress at exit varies: more than one exit
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(store_path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0 and "saved" in out.stdout, out.stderr
        assert "compaction" not in out.stderr, out.stderr
    with ckstore.open(store_path) as store:
        assert len(store.log("titan")) == 12
        for snap in store.log("titan"):
            step = snap.step
            g = torch.Generator().manual_seed(step)
            want = {f"w{i}": torch.randn(2**19, generator=g) for i in range(8)}
            got = snap.read_object("dcp/w3")
            assert torch.equal(got, want["w3"])
        assert store.check().ok


def test_a_compaction_whose_session_ended_at_exit_stops_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The race behind the test above, made certain: at exit the process ends the sessions it
    holds (``lease._end_at_exit``) while the compaction still writes, so its next write fails
    the lease check. That is the stop, not a fault: no warning. The same failure before exit
    is still reported."""
    with ckstore.open(tmp_path / "store", create=True, auto_compact=False) as store:
        compactor = AutoCompactor(store.repository)

        def job() -> None:
            raise LeaseExpiredError("write session 851b is aborted, not active")

        with caplog.at_level(logging.WARNING, logger="ckstore"):
            assert compactor._run(job, "compaction", "retried later")  # the thread goes on
            assert "background compaction" in caplog.text and "LeaseExpiredError" in caplog.text
            caplog.clear()
            monkeypatch.setattr(lease, "_exiting", threading.Event())
            lease._exiting.set()  # what lease._end_at_exit does first
            assert not compactor._run(job, "compaction", "retried later")  # the thread ends
        assert caplog.text == ""
