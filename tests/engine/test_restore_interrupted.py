"""An atomic restore interrupted while it puts the checked chunks in place (Ctrl-C, or a
preemption handler of the program's that raises on SIGTERM): before, the interrupt stopped the
second pass after the jobs in progress and came back with the caller's tensors part restored,
part as they were, with nothing saying so. Now the pass runs to its end and the interrupt is
raised after it: the destination is wholly restored (``engine/restore/phases.py``,
``apply``)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.restore import fetch

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _preempted(sig: int) -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_the_second_pass_leaves_the_destination_wholly_restored(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, sig: int
) -> None:
    store = ckstore.open(tmp_path / "s", create=True, chunk_bytes=1 << 16)
    torch.manual_seed(0)
    src = {f"w{i}": torch.randn(1 << 16) for i in range(16)}
    store.take({"m": ckstore.StateDict(**src)}, run="r", step=1)
    dst = ckstore.StateDict(**{k: torch.zeros_like(v) for k, v in src.items()})
    real_apply, real_deliver = fetch.Fetcher.apply, fetch.Fetcher._deliver  # noqa: SLF001
    timers: list[threading.Timer] = []

    def apply(self: Any, jobs: Any) -> None:
        timers.append(threading.Timer(0.2, _preempted, (sig,)))
        timers[-1].start()
        real_apply(self, jobs)

    def deliver(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)  # a large state: the pass takes seconds
        return real_deliver(self, *args, **kwargs)

    def preemption(signum: int, frame: Any) -> None:
        sys.exit(143)

    monkeypatch.setattr(fetch.Fetcher, "apply", apply)
    monkeypatch.setattr(fetch.Fetcher, "_deliver", deliver)
    old = signal.signal(signal.SIGTERM, preemption)
    try:
        with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else SystemExit):
            store.get("r@1").restore({"m": dst})
    finally:
        for t in timers:
            t.join()
        signal.signal(signal.SIGTERM, old)
    restored = [k for k in src if torch.equal(dst[k], src[k])]
    assert restored == list(src), f"{len(restored)} of {len(src)} tensors restored"
    monkeypatch.undo()
    assert store.check(read_data=True).ok
    store.close()


def test_a_cancel_from_the_progress_callback_while_writing_says_the_destination_is_partial(
    tmp_path: Any,
) -> None:
    """A ``progress`` callback that raises is how a caller cancels; raised while the checked
    chunks are put in place, it leaves the destination partly loaded, and now says so."""
    store = ckstore.open(tmp_path / "s", create=True, chunk_bytes=1 << 16)
    torch.manual_seed(0)
    src = {f"w{i}": torch.randn(1 << 16) for i in range(16)}
    store.take({"m": ckstore.StateDict(**src)}, run="r", step=1)
    dst = ckstore.StateDict(**{k: torch.zeros_like(v) for k, v in src.items()})
    told: list[tuple[str, int]] = []

    class Cancelled(Exception):
        pass

    def progress(what: str, done: int, total: int) -> None:
        told.append((what, done))
        if what == "restore" and done:  # the second pass has put some chunks in place
            raise Cancelled

    with pytest.raises(Cancelled) as exc:
        store.get("r@1").restore({"m": dst}, progress=progress)
    notes = getattr(exc.value, "__notes__", [])
    assert any("partly loaded" in n and "r@1" in n for n in notes), (notes, told)
    store.close()
