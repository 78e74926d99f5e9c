"""async_take under a staging budget: the snapshot is the state at the call, memory bounded."""

from __future__ import annotations

import torch

import ckstore
from ckstore.engine.take import single


def _pack_bytes(store) -> int:
    return sum(store.repository.objects.pack_size(p) for p in store.repository.objects.list_packs())


def _state():
    return ckstore.StateDict(
        a=torch.randn(128, 64), b=torch.randn(128, 64), c=torch.randn(64, 64), step=1
    )


def _mutate(state):
    for k in ("a", "b", "c"):
        state[k].mul_(-1).add_(3.0)
    state["step"] = 2


def test_past_the_budget_tensors_are_stored_before_returning(store):
    state = _state()
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = store.async_take({"s": state}, run="r", staging_budget=0)
    assert pending.staged_bytes == 0 and pending.sync_bytes == (2 * 128 + 64) * 64 * 4
    assert _pack_bytes(store) > 0  # the uncopied tensors were written before the call returned
    _mutate(state)
    snap = pending.wait(timeout=60)
    got = snap.read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items()) and got["step"] == 1


def test_a_partial_budget_copies_what_fits_and_stores_the_rest_now(store):
    state = _state()
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    budget = 128 * 64 * 4  # exactly one of the big tensors
    pending = store.async_take({"s": state}, run="r", staging_budget=budget)
    assert 0 < pending.staged_bytes <= budget and pending.sync_bytes > 0
    _mutate(state)
    got = pending.wait(timeout=60).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items()) and got["step"] == 1


def test_an_ample_budget_copies_everything(store):
    state = _state()
    pending = store.async_take({"s": state}, run="r", staging_budget=1 << 30)
    assert pending.sync_bytes == 0 and pending.staged_bytes == (2 * 128 + 64) * 64 * 4
    _mutate(state)
    assert pending.wait(timeout=60).read_object("s/step") == 1


def test_budget_from_the_environment(store_path, monkeypatch):
    monkeypatch.setenv("CKSTORE_STAGING_BUDGET", "777")
    assert ckstore.open(store_path, create=True).staging_budget == 777


def test_a_loop_of_async_takes_reuses_its_staging_memory_and_each_snapshot_stays_right(
    store, monkeypatch
):
    """The second take copies into the first one's staging arena (memory already touched), only
    once the first is done with it; a take still running keeps its own."""
    state = _state()
    wants, snaps, arenas = [], [], []
    real = single.arena_for

    def spy(repo, nbytes: int, pinned: bool = False):
        arena = real(repo, nbytes, pinned)
        arenas.append(arena)
        return arena

    monkeypatch.setattr(single, "arena_for", spy)
    for step in range(3):
        wants.append({k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
        snaps.append(store.async_take({"s": state}, run="r", step=step).wait(timeout=60))
        _mutate(state)
    assert arenas[0] is arenas[1] is arenas[2]  # reused, take after take
    running = store.async_take(
        {"s": state}, run="r", step=3
    )  # not waited for: its arena is in use...
    other = store.async_take({"s": state}, run="r2", step=3)
    assert arenas[3] is not arenas[4]  # ...so the next take gets another one
    running.wait(timeout=60)
    other.wait(timeout=60)
    for snap, want in zip(
        snaps, wants
    ):  # the copies were overwritten since: the snapshots were not
        got = snap.read_object("s")
        assert all(torch.equal(got[k], v) for k, v in want.items())
