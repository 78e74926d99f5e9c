"""A handler the program installs while an atomic restore runs (an app's ``load_state_dict``
that sets up its own SIGINT/SIGTERM handling, say) is the program's after the restore: the
restore holds interrupts by swapping the handlers in for its second pass
(``engine/restore/phases.py``), and put back the ones it found over the program's new one."""

from __future__ import annotations

import signal
import sys
from typing import Any

import pytest
import torch

import ckstore

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _mine(signum: int, frame: Any) -> None:
    pass


class App:
    def __init__(self) -> None:
        self.w = torch.zeros(16)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"]
        signal.signal(signal.SIGINT, _mine)  # the program's own Ctrl-C handling from now on


def test_a_handler_installed_during_the_restore_stays(tmp_path: Any) -> None:
    store = ckstore.open(tmp_path / "s", create=True)
    store.take({"m": ckstore.StateDict(w=torch.arange(16.0))}, run="r", step=1)
    before = signal.getsignal(signal.SIGINT)
    app = App()
    try:
        store.get("r@1").restore({"m": app})
        assert torch.equal(app.w, torch.arange(16.0))
        assert signal.getsignal(signal.SIGINT) is _mine
    finally:
        signal.signal(signal.SIGINT, before)
        store.close()
