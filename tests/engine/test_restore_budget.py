"""Restore under a staging budget: bounded memory without giving up atomicity (and\n``atomic=False``: one pass straight into place)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from tests.support.states import flip_byte_of


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    return {"m": model, "s": ckstore.StateDict(t=torch.randn(30, 40).t(), step=3)}


@pytest.mark.parametrize(
    ("budget", "atomic"), [(0, True), (1 << 30, True), (0, False), (1 << 30, False)]
)
def test_restore_is_exact_and_in_place_with_or_without_staging(store, budget, atomic):
    src = _state()
    store.take(src, run="r")
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    dest = {
        "m": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        "s": ckstore.StateDict(t=torch.zeros(30, 40).t(), step=0),
    }
    ptrs = [p.data_ptr() for p in dest["m"].parameters()] + [dest["s"]["t"].data_ptr()]
    snap = store.get("r")
    _ = snap.manifest  # not tensor data
    counting.reset()
    snap.restore(dest, memory_budget=budget, atomic=atomic)
    assert ptrs == [p.data_ptr() for p in dest["m"].parameters()] + [dest["s"]["t"].data_ptr()]
    assert all(
        torch.equal(a, b)
        for a, b in zip(src["m"].state_dict().values(), dest["m"].state_dict().values())
    )
    assert torch.equal(dest["s"]["t"], src["s"]["t"]) and dest["s"]["step"] == 3
    chunk_reads = sum(1 for g in counting.gets if g.name.startswith("packs/"))
    n_chunks = len(snap.manifest.chunk_ids())
    # every chunk is read once: past the budget an atomic restore keeps the mapped views it
    # checked and puts them in place without reading them again
    assert chunk_reads == n_chunks


def test_a_damaged_chunk_is_found_before_the_destination_changes_even_past_the_budget(store):
    snap = store.take(_state(), run="r")
    flip_byte_of(store, snap, "m/1.weight")
    dest = {
        "m": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        "s": ckstore.StateDict(t=torch.zeros(30, 40).t(), step=0),
    }
    before = copy.deepcopy(dest["m"].state_dict())
    with pytest.raises(ckstore.CorruptionError, match="'m/1.weight'"):
        store.get("r").restore(dest, memory_budget=0)
    assert all(torch.equal(v, before[k]) for k, v in dest["m"].state_dict().items())
    assert dest["s"]["step"] == 0 and torch.equal(dest["s"]["t"], torch.zeros(30, 40).t())


def test_budget_from_the_environment(store_path, monkeypatch):
    monkeypatch.setenv("CKSTORE_MEMORY_BUDGET", "12345")
    assert ckstore.open(store_path, create=True).memory_budget == 12345


def test_non_atomic_restore_still_refuses_damaged_bytes_and_says_it_loaded_part(store):
    snap = store.take(_state(), run="r")
    flip_byte_of(store, snap, "m/1.weight")
    dest = {
        "m": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        "s": ckstore.StateDict(t=torch.zeros(30, 40).t(), step=0),
    }
    with pytest.raises(ckstore.CorruptionError, match=r"'m/1.weight'.*partly loaded.*atomic=False"):
        store.get("r").restore(dest, atomic=False)
    assert dest["s"]["step"] == 0  # load_state_dict never ran


def test_non_atomic_restore_checks_keys_and_shapes_before_loading(store):
    store.take(_state(), run="r")
    dest = {
        "m": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)),
        "s": ckstore.StateDict(t=torch.zeros(30, 40).t(), step=0),
    }
    before = copy.deepcopy(dest["m"].state_dict())
    with pytest.raises(ckstore.MismatchError, match="m/1.weight"):
        store.get("r").restore(dest, atomic=False)
    assert all(torch.equal(v, before[k]) for k, v in dest["m"].state_dict().items())


def test_a_small_restore_runs_on_the_calling_thread_and_a_large_one_on_workers(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``fetch.INLINE_BYTES`` starting worker threads costs more than it saves: no pool
    is made. Above it the chunks are spread over the store's threads. Both restore exactly."""
    from ckstore.engine.restore import fetch

    made: list[int] = []
    real = fetch.ThreadPoolExecutor

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("max_workers", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(fetch, "ThreadPoolExecutor", counting)
    src = _state()
    store.take(src, run="r")
    store.threads = 2
    for inline, atomic in [
        (fetch.INLINE_BYTES, True),
        (fetch.INLINE_BYTES, False),
        (1, True),
        (1, False),
    ]:
        monkeypatch.setattr(fetch, "INLINE_BYTES", inline)
        made.clear()
        dest = {
            "m": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
            "s": ckstore.StateDict(t=torch.zeros(30, 40).t(), step=0),
        }
        store.get("r").restore(dest, atomic=atomic, memory_budget=0)
        assert all(
            torch.equal(a, b)
            for a, b in zip(src["m"].state_dict().values(), dest["m"].state_dict().values())
        )
        assert torch.equal(dest["s"]["t"], src["s"]["t"])
        assert made == ([] if inline > 1 else [2]), (inline, atomic, made)
