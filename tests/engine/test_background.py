"""Work behind training (``engine/background.py``): threads at the lowest CPU priority, as many
as the machine leaves idle; the part of an async take past its call and background compaction
run on them, the part the caller waits for does not."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckstore
from ckstore.engine import background
from ckstore.engine.take import guard
from ckstore.engine.take.packing import TakeOptions
from ckstore.engine.take.single import reserved_bytes


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lower_priority_lowers_the_calling_thread_only():
    before = _nice()
    seen = []

    def worker():
        background.lower_priority()
        seen.append(_nice())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [background.LOWEST] and _nice() == before


def test_a_polite_pool_runs_its_work_at_the_lowest_priority():
    with background.polite_pool(2, "test-polite") as pool:
        assert set(pool.map(lambda _: _nice(), range(8))) == {background.LOWEST}


def test_idle_cores_is_a_whole_number_of_cores_at_least_one():
    n = background.idle_cores()
    assert isinstance(n, int) and 1 <= n <= (os.cpu_count() or 1)


def test_an_async_take_hashes_the_staged_part_politely_and_the_part_past_its_budget_at_once(
    store, monkeypatch
):
    """The tensors past the budget are stored before the call returns, on normal-priority
    workers (the caller waits for them); the copies are hashed behind training."""
    store.threads = 2
    store.background_threads = 1
    priorities: dict[str, set[int]] = {}
    real = guard.TakeGuard.hash_chunk

    def spy(self, chunk):
        priorities.setdefault(chunk.key, set()).add(_nice())
        return real(self, chunk)

    monkeypatch.setattr(guard.TakeGuard, "hash_chunk", spy)
    state = ckstore.StateDict(a=torch.randn(128, 64), b=torch.randn(128, 64))
    reserved = reserved_bytes(TakeOptions.of(store.repository), 1, 1 << 40)
    pending = store.async_take({"s": state}, run="r", staging_budget=reserved + 128 * 64 * 4)
    pending.wait(timeout=60)
    staged = {k for k in priorities if priorities[k] == {background.LOWEST}}
    assert len(staged) == 1 and len(priorities) == 2
    assert all(min(p) < background.LOWEST for k, p in priorities.items() if k not in staged)


def test_the_background_threads_knob(store):
    assert store.background_threads >= 1
    store.background_threads = 3
    assert store.background_threads == store.repository.background_threads == 3
    store.background_threads = None
    assert store.background_threads >= 1
    with pytest.raises(ckstore.InvalidInputError, match="background_threads"):
        store.background_threads = 0
