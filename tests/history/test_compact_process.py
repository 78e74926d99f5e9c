"""The compaction after takes in a helper process (knob ``background_process``): it runs there
and not in the training process, it waits while this process takes or restores, it stops when
asked, a helper killed mid-run loses nothing, and closing the store ends it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import ckstore
from ckstore.errors import StorageError
from ckstore.history import compact as compact_module
from ckstore.history import compact_process
from tests.support.procs import gone


def _state(step: int) -> ckstore.StateDict:
    gen = torch.Generator().manual_seed(step)
    return ckstore.StateDict(w=torch.randn(1 << 18, generator=gen), step=step)


def _take_three(store: ckstore.Store) -> dict[int, torch.Tensor]:
    want = {}
    for step in range(3):
        state = _state(step)
        store.take({"m": state}, run="r", step=step)
        want[step] = state["w"].clone()
    return want


def _loose(store: ckstore.Store) -> set[str]:
    return {c.chunk_id for c in store.repository.index.loose_chunks()}


def _restores(store: ckstore.Store, want: dict[int, torch.Tensor]) -> bool:
    for step, w in want.items():
        out = ckstore.StateDict(w=torch.zeros_like(w), step=-1)
        store.get(f"r@{step}").restore({"m": out})
        if not torch.equal(out["w"], w) or out["step"] != step:
            return False
    return True


def _pid(store: ckstore.Store) -> int | None:
    return compact_process.helper_for(store.repository).pid


@pytest.fixture
def helped(store_path, monkeypatch) -> ckstore.Store:
    """A store whose compaction must run in its helper: this process's is made to fail."""
    store = ckstore.open(store_path, create=True, auto_compact=False)
    store.background_process = True

    def here(*args, **kwargs):
        raise AssertionError("compaction ran in the training process")

    monkeypatch.setattr(compact_module, "compact", here)
    yield store
    store.close()


def test_takes_are_compacted_in_the_helper_and_every_snapshot_restores(helped):
    helped.auto_compact = True
    want = _take_three(helped)
    assert helped.wait_compacted(120)
    report = helped.last_compaction
    assert report is not None and report.chunks >= 2 and report.dense_bytes < report.loose_bytes
    pid = _pid(helped)
    assert pid is not None and pid != os.getpid()
    assert _restores(helped, want)


def test_the_helper_waits_while_this_process_is_busy_then_compacts(helped):
    want = _take_three(helped)
    before = _loose(helped)
    busy = threading.Event()
    busy.set()
    got: list[dict] = []
    worker = threading.Thread(
        target=lambda: got.append(
            compact_process.compact_in_helper(helped.repository, 1, busy.is_set, lambda: False)
        )
    )
    worker.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # busy: the helper started, planned, and rewrites nothing
        assert _loose(helped) == before and worker.is_alive()
        time.sleep(0.2)
    busy.clear()
    worker.join(120)
    assert got and got[0]["chunks"] >= 2
    assert _loose(helped) < before
    assert _restores(helped, want)


def test_asked_to_stop_the_helper_rewrites_nothing_more(helped):
    want = _take_three(helped)
    before = _loose(helped)
    report = compact_process.compact_in_helper(helped.repository, 1, lambda: False, lambda: True)
    assert report["chunks"] == 0 and _loose(helped) == before
    assert _restores(helped, want)


def test_a_helper_killed_mid_run_loses_nothing_and_the_next_run_starts_another(helped):
    want = _take_three(helped)
    busy = threading.Event()
    busy.set()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            compact_process.compact_in_helper(helped.repository, 1, busy.is_set, lambda: False)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 60
    while _pid(helped) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first = _pid(helped)
    assert first is not None
    time.sleep(1.0)  # it opened the store and waits between chunks
    os.kill(first, signal.SIGKILL)
    worker.join(60)
    assert len(errors) == 1 and isinstance(errors[0], StorageError)
    assert "compaction" in str(errors[0])
    assert _restores(helped, want)
    report = compact_process.compact_in_helper(helped.repository, 1, lambda: False, lambda: False)
    assert report["chunks"] >= 2 and _pid(helped) not in (None, first)
    assert _restores(helped, want)
    assert helped.check().ok


def test_closing_the_store_ends_its_compaction_helper(store_path):
    store = ckstore.open(store_path, create=True, auto_compact=False)
    store.background_process = True
    _take_three(store)
    compact_process.compact_in_helper(store.repository, 1, lambda: False, lambda: False)
    pid = _pid(store)
    assert pid is not None
    store.close()
    deadline = time.monotonic() + 30
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


def test_compaction_stays_in_this_process_where_the_helper_cannot_open_the_store(tmp_path):
    store = ckstore.open(f"memory://{tmp_path.name}", create=True, auto_compact=False)
    store.background_process = True
    assert not compact_process.in_helper(store.repository)
    store.close()
