"""async_take finished in a helper process (knob ``background_process``): the snapshot is the
state at the call, the helper's warnings and failures reach the caller, and a dead helper costs
the take in flight only."""

from __future__ import annotations

import os
import signal
import time
import uuid
import warnings

import pytest
import torch

import ckstore
from ckstore.engine.take import offload
from tests.support.procs import gone


def _state(step: int = 1) -> ckstore.StateDict:
    gen = torch.Generator().manual_seed(step)
    return ckstore.StateDict(
        a=torch.randn(128, 64, generator=gen), b=torch.randn(64, 64, generator=gen), step=step
    )


def _helper_pid(store: ckstore.Store) -> int | None:
    return offload.helper_for(store.repository).pid


@pytest.fixture
def offloading(store: ckstore.Store) -> ckstore.Store:
    store.background_process = True
    return store


def test_an_offloaded_take_stores_the_state_at_the_call(offloading):
    state = _state()
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = offloading.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30)
    assert pending.sync_bytes == 0 and pending.staged_bytes == (128 + 64) * 64 * 4
    state["a"].mul_(-1)
    state["step"] = 2
    snap = pending.wait(timeout=120)
    pid = _helper_pid(offloading)
    assert pid is not None and pid != os.getpid()  # the take went to a helper process
    got = snap.read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items()) and got["step"] == 1
    assert offloading.get("r@1").id == snap.id  # committed in the store this process opened


def test_a_loop_of_offloaded_takes_reuses_one_helper_and_closing_stops_it(store_path):
    store = ckstore.open(store_path, create=True)
    store.background_process = True
    pids = set()
    for step in range(1, 4):
        state = _state(step)
        store.async_take({"s": state}, run="r", step=step, staging_budget=1 << 30).wait(120)
        pids.add(_helper_pid(store))
        assert torch.equal(store.get(f"r@{step}").read_object("s/a"), state["a"])
    assert len(pids) == 1 and None not in pids
    store.close()
    assert gone(pids.pop())


def test_the_helpers_warnings_reach_the_caller(offloading):
    model = torch.nn.Linear(16, 16)
    offloading.async_take({"m": model}, run="r", step=1, staging_budget=1 << 30).wait(120)
    with torch.no_grad():
        model.weight.add_(1.0)  # the bias stays as it was: stale although it should train
    with pytest.warns(ckstore.errors.StaleStateWarning, match="bias"):
        pending = offloading.async_take({"m": model}, run="r", step=2, staging_budget=1 << 30)
        pending.wait(120)


def test_a_dead_helper_fails_the_take_in_flight_and_the_next_starts_a_new_one(offloading):
    offloading.async_take({"s": _state(1)}, run="r", step=1, staging_budget=1 << 30).wait(120)
    pid = _helper_pid(offloading)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the next take is sent, and stays in flight
    try:
        pending = offloading.async_take({"s": _state(2)}, run="r", step=2, staging_budget=1 << 30)
    finally:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(ckstore.errors.StorageError, match="exited before this take was done"):
        pending.wait(120)
    state = _state(3)
    snap = offloading.async_take({"s": state}, run="r", step=3, staging_budget=1 << 30).wait(120)
    assert torch.equal(snap.read_object("s/a"), state["a"])
    assert _helper_pid(offloading) not in (None, pid)
    assert [s.step for s in offloading.log("r")] == [3, 1]  # nothing committed for step 2


def test_past_the_budget_a_take_finishes_in_this_process(offloading):
    state = _state()
    want = state["a"].clone()
    pending = offloading.async_take({"s": state}, run="r", step=1, staging_budget=0)
    assert pending.staged_bytes == 0
    state["a"].zero_()
    assert torch.equal(pending.wait(120).read_object("s/a"), want)


def test_an_in_memory_store_finishes_its_takes_in_this_process():
    store = ckstore.open(f"memory://store-{uuid.uuid4().hex}", create=True)
    try:
        store.background_process = True
        assert "in-memory" in (offload.unavailable(store.repository) or "")
        state = _state()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no helper, no warning about one
            snap = store.async_take({"s": state}, run="r", step=1).wait(120)
        assert torch.equal(snap.read_object("s/a"), state["a"])
    finally:
        store.close()


def test_prepare_staging_readies_the_shared_memory_the_first_offloaded_take_copies_into(
    offloading, monkeypatch
):
    from ckstore.engine.take import single

    state = _state()
    used = []
    real = single.arena_for

    def spy(repo, nbytes, pinned=False, shared=False):
        arena = real(repo, nbytes, pinned, shared)
        used.append(arena)
        return arena

    monkeypatch.setattr(single, "arena_for", spy)
    prepared = offloading.prepare_staging({"s": state}, staging_budget=1 << 30).result(60)
    assert _helper_pid(offloading) is not None  # the helper started ahead too
    snap = offloading.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30).wait(120)
    assert used[0].shared and used[0].size == prepared
    assert used[1] is used[0]  # the take copied into the prepared shared memory
    assert torch.equal(snap.read_object("s/a"), state["a"])


def test_the_helper_runs_behind_training_in_its_scheduling_group_too(offloading):
    """A helper is a session of its own; where the kernel groups processes by session
    (autogroup), its threads' nice value weighs only within its group, so the group's is set."""
    offloading.async_take({"s": _state(1)}, run="r", step=1, staging_budget=1 << 30).wait(120)
    pid = _helper_pid(offloading)
    assert pid is not None
    assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    group = f"/proc/{pid}/autogroup"
    if os.path.exists(f"/proc/{os.getpid()}/autogroup"):  # a kernel built with autogroups
        with open(group) as f:
            assert f.read().split()[-1] == "19"


def test_a_take_past_its_budget_then_an_offloaded_one_commit_in_call_order(offloading, monkeypatch):
    """The first finishes in a thread here (past its budget), slowly; the second goes to the
    helper. Before, the helper committed the second first and the first became the run's
    latest: a resume took the older state."""
    import threading

    from ckstore.engine.take.local import LocalTake

    gate = threading.Event()
    real = LocalTake.manifest

    def manifest(self, *a, **k):
        if self.spec.step == 1:  # only this process's take: the helper has its own LocalTake
            assert gate.wait(60)
        return real(self, *a, **k)

    monkeypatch.setattr(LocalTake, "manifest", manifest)
    first = offloading.async_take({"s": _state(1)}, run="r", step=1, staging_budget=0)
    second = offloading.async_take({"s": _state(2)}, run="r", step=2, staging_budget=1 << 30)
    deadline = time.monotonic() + 6  # before, the helper committed the second meanwhile
    while not second.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    gate.set()
    assert first.wait(timeout=120).step == 1
    assert second.wait(timeout=120).step == 2
    assert _helper_pid(offloading) is not None  # the second went to the helper
    assert offloading.get("r").step == 2
