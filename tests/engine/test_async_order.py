"""Two async takes of one run in flight at once, the first slower (a bigger state, a slow disk):
before, the one that committed last became the run's latest and ``run@step``, whatever the
order they were called in, and a resume took the older state. A handle's async takes now
commit in call order (``engine/take/single.py``, ``_in_call_order``): the second waits, at its
commit, for the first."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.take.local import LocalTake


def _slow_first(monkeypatch: pytest.MonkeyPatch, first: Any) -> threading.Event:
    """Hold the take whose spec ``first`` accepts before its manifest (its hashing and writing
    take long) until the event is set."""
    gate = threading.Event()
    real = LocalTake.manifest

    def manifest(self: LocalTake, *a: Any, **k: Any) -> Any:
        if first(self.spec):
            assert gate.wait(60)
        return real(self, *a, **k)

    monkeypatch.setattr(LocalTake, "manifest", manifest)
    return gate


def test_the_newer_async_take_is_the_runs_latest_though_the_older_finished_last(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _slow_first(monkeypatch, lambda spec: spec.step == 100)
    state = ckstore.StateDict(w=torch.zeros(512), step=100)
    first = store.async_take({"m": state}, run="r", step=100)
    state["w"].add_(1.0)
    state["step"] = 200
    second = store.async_take({"m": state}, run="r", step=200)
    time.sleep(0.5)
    assert not second.done()  # ready to commit, it waits for the first
    gate.set()
    assert first.wait(timeout=60).step == 100
    assert second.wait(timeout=60).step == 200
    assert store.get("r").step == 200


def test_a_step_saved_twice_asynchronously_names_the_second_state(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _slow_first(monkeypatch, lambda spec: spec.metadata.get("save") == "first")
    state = ckstore.StateDict(w=torch.zeros(512))
    first = store.async_take({"m": state}, run="r", step=100, metadata={"save": "first"})
    state["w"].add_(1.0)  # the trainer steps the optimizer, then saves step 100 again
    second = store.async_take({"m": state}, run="r", step=100, metadata={"save": "second"})
    gate.set()
    first.wait(timeout=60)
    second.wait(timeout=60)
    assert torch.equal(store.get("r@100").read_object("m/w"), torch.ones(512))


def test_a_failed_async_take_does_not_hold_up_the_next(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _slow_first(monkeypatch, lambda spec: spec.step == 1)
    real = LocalTake.commit

    def commit(self: LocalTake, manifest: Any, *a: Any, **k: Any) -> Any:
        if self.spec.step == 1:
            raise OSError("injected: the disk went away")
        return real(self, manifest, *a, **k)

    monkeypatch.setattr(LocalTake, "commit", commit)
    first = store.async_take({"m": ckstore.StateDict(w=torch.zeros(64))}, run="r", step=1)
    second = store.async_take({"m": ckstore.StateDict(w=torch.ones(64))}, run="r", step=2)
    gate.set()
    with pytest.raises(OSError, match="injected"):
        first.wait(timeout=60)
    assert second.wait(timeout=60).step == 2


@pytest.mark.parametrize("offloaded", [False, True], ids=["thread", "helper-process"])
def test_an_async_take_whose_call_failed_to_start_its_thread_does_not_hold_up_the_next(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch, offloaded: bool
) -> None:
    """The process is at its thread limit once (a container's ``pids.max``): the call raises.
    Before, its take stayed the handle's last async take, never resolved, and every later
    async take (then ``Store.close``) waited for it forever."""
    from concurrent.futures import TimeoutError as FutureTimeout

    store.background_process = offloaded
    real_start = threading.Thread.start
    failed: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        if self.name == "ckstore-async-take" and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    state = ckstore.StateDict(w=torch.zeros(4096), step=1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        store.async_take({"m": state}, run="r", step=1, staging_budget=1 << 30)
    state["w"].add_(1.0)
    second = store.async_take({"m": state}, run="r", step=2, staging_budget=1 << 30)
    try:
        assert second.wait(timeout=60).step == 2
    except FutureTimeout:
        pytest.fail("the next async_take waits for the failed call's take")
    assert [s.step for s in store.log("r")] == [2]
    assert torch.equal(store.get("r").read_object("m/w"), torch.ones(4096))
