"""A ``dcp.save`` into a marked folder whose process stops (SIGSTOP, a suspended laptop, a job
frozen by its scheduler) between its commit and its step pointer, past its lease, while another
save into the folder runs its retention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp  # noqa: E402  (ships with the torch we pin)

import ckstore
from tests.dcp import folder_scenarios as fs
from tests.support.paths import REPO
from tests.support.procs import wait_stopped

_PAUSED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    import ckstore
    import ckstore.dcp.folder_writer as folder_writer
    from tests.dcp import folder_scenarios as fs

    real = folder_writer.write_pointer

    def write_pointer(at, pointer):  # committed; stopped before the pointer names it
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(at, pointer)

    folder_writer.write_pointer = write_pointer
    try:
        dcp.save(fs.step_state(2), checkpoint_id=os.path.join(sys.argv[1], "step-2"))
    except BaseException as exc:  # CheckpointException is a BaseException
        print(f"failed {type(exc).__name__}: {exc}")
        sys.exit(3)
    print("saved")
    """
)


def test_a_save_paused_past_its_lease_before_its_pointer_never_reports_a_deleted_step(
    tmp_path: Path,
) -> None:
    """Save B commits step 2 and stops before writing its pointer; its lease runs out; save A of
    step 3 takes step 2 for a removed step (no pointer, its saving session no longer live) and
    deletes its snapshot. Before, B then resumed, wrote a pointer naming the deleted snapshot
    and returned as saved: ``step-2`` was listed by the trainer, and loading it failed. Either
    B fails, or step 2 loads."""
    url, folder = fs.marked_titan(tmp_path)
    env = dict(os.environ, CKSTORE_LEASE_SECONDS="1.0")
    child = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_SAVE, folder],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_stopped(child, within_s=120)
        time.sleep(1.5)  # B's lease runs out while it is stopped
        dcp.save(fs.step_state(3), checkpoint_id=os.path.join(folder, "step-3"))
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    assert child.returncode in (0, 3), (out, err)
    if child.returncode == 0:  # B said saved: step 2 must load
        got = {"w": torch.zeros(4096)}
        dcp.load(got, checkpoint_id=os.path.join(folder, "step-2"))
        assert torch.equal(got["w"], fs.step_state(2)["w"])
    for step in (1, 3):
        got = {"w": torch.zeros(4096)}
        dcp.load(got, checkpoint_id=os.path.join(folder, f"step-{step}"))
        assert torch.equal(got["w"], fs.step_state(step)["w"])
    with ckstore.open(url) as store:
        assert store.check(read_data=True).ok
