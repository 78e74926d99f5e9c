"""A ``dcp.save`` into a marked folder whose index is out of reach for a moment right after
its commit and pointer (a PostgreSQL restarting, a network blip): the step is committed and
its pointer names it, so the save succeeds, as a take does across such a blip
(``engine/lease.py``). The check that its session still holds (``folder_writer._still_held``)
turned the blip into a failed save."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckstore.errors import IndexDatabaseError
from ckstore.index.sessions import Sessions
from tests.dcp import folder_scenarios as fs


def test_a_blip_of_the_index_after_the_pointer_does_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _url, folder = fs.marked_titan(tmp_path)
    real = Sessions.heartbeat
    blips: list[str] = []

    def heartbeat(self, session_id: str, lease_seconds: float) -> None:  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread() and not blips:  # a blip
            blips.append(session_id)
            raise IndexDatabaseError("the index is out of reach (connection refused)")
        return real(self, session_id, lease_seconds)

    monkeypatch.setattr(Sessions, "heartbeat", heartbeat)
    dcp.save(fs.step_state(2), checkpoint_id=os.path.join(folder, "step-2"))
    monkeypatch.undo()
    assert blips, "the save checked its session after its pointer"
    got = {"w": torch.zeros(4096)}
    dcp.load(got, checkpoint_id=os.path.join(folder, "step-2"))
    assert torch.equal(got["w"], fs.step_state(2)["w"])
