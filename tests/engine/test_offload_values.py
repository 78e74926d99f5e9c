"""async_take with ``background_process``: the plain values of the state go to the helper
process as they were at the call, and one the helper cannot receive does not hold anything up.

Before, the job was encoded for the helper only when the background thread sent it (after the
call returned, and after the handle's previous async take): a list, ``bytearray`` or
``BytesIO`` the training loop changed meanwhile was stored changed. And a value that could not
be encoded (an ``IntEnum`` defined in a function) failed the take after its reply was awaited:
that stale wait took the helper's next reply, and every later async take of the handle, and
``store.close()``, waited forever. And a value of a class the training script defines
(``__main__``) was encoded, but the helper, whose ``__main__`` is its own, could not decode it:
the helper died and the take failed, where a thread commits it."""

from __future__ import annotations

import enum
import io
import os
import signal
import sys

import pytest
import torch

import ckstore
from ckstore.engine.take import offload


@pytest.fixture
def offloading(store: ckstore.Store) -> ckstore.Store:
    store.background_process = True
    return store


def test_offloaded_take_stores_mutable_values_as_at_the_call(offloading):
    # a first take in flight: the second's job is sent only once it committed
    first = offloading.async_take(
        {"s": ckstore.StateDict(w=torch.randn(64, 64))}, run="r", step=1, staging_budget=1 << 30
    )
    state = ckstore.StateDict(
        w=torch.randn(64, 64),
        history=[1, 2, 3],
        blob=bytearray(b"old-bytes"),
        bio=io.BytesIO(b"old-bio"),
    )
    pending = offloading.async_take({"s": state}, run="r", step=2, staging_budget=1 << 30)
    assert pending.sync_bytes == 0
    # the training loop goes on: mutates its Python values in place
    state["history"].append(4)
    state["history"][0] = 100
    state["blob"][:3] = b"NEW"
    state["bio"].seek(0)
    state["bio"].write(b"NEW")
    first.wait(timeout=120)
    snap = pending.wait(timeout=120)
    got = snap.read_object("s")
    assert (got["history"], bytes(got["blob"]), got["bio"].getvalue()) == (
        [1, 2, 3],
        b"old-bytes",
        b"old-bio",
    )


def test_threaded_take_stores_mutable_values_as_at_the_call(store):
    """Control: the same without the helper holds (planning encodes values at the call)."""
    first = store.async_take({"s": ckstore.StateDict(w=torch.randn(64, 64))}, run="r", step=1)
    state = ckstore.StateDict(
        w=torch.randn(64, 64), history=[1, 2, 3], blob=bytearray(b"old-bytes")
    )
    pending = store.async_take({"s": state}, run="r", step=2)
    state["history"].append(4)
    state["blob"][:3] = b"NEW"
    first.wait(timeout=120)
    got = pending.wait(timeout=120).read_object("s")
    assert got["history"] == [1, 2, 3] and bytes(got["blob"]) == b"old-bytes"


def test_a_value_the_job_cannot_pickle_does_not_wedge_later_takes(offloading):
    class Phase(enum.IntEnum):  # an int: a plain value ckstore stores (as the int)
        WARMUP = 1

    state = ckstore.StateDict(w=torch.randn(64, 64), phase=Phase.WARMUP)
    first = offloading.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30)
    first_error = None
    try:
        first.wait(timeout=120)
    except Exception as exc:  # noqa: BLE001 - checked below
        first_error = exc
    plain = ckstore.StateDict(w=torch.randn(64, 64), phase=1)
    second = offloading.async_take({"s": plain}, run="r", step=2, staging_budget=1 << 30)
    try:
        snap = second.wait(timeout=60)
    except TimeoutError:
        pid = offload.helper_for(offloading.repository).pid
        if pid is not None:  # unwedge, so that the test ends (and store.close() returns)
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the next async take never finished (first take raised {first_error!r})")
    assert snap.step == 2
    assert first_error is None, first_error  # the same take without the helper commits


class Phase(enum.IntEnum):
    WARMUP = 1


def test_a_value_of_a_main_class_is_stored_by_an_offloaded_take(store, monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(Phase, "__module__", "__main__")
    monkeypatch.setattr(main, "Phase", Phase, raising=False)  # as if defined in train.py
    store.background_process = True
    state = ckstore.StateDict(w=torch.randn(64, 64), phase=Phase.WARMUP)
    pending = store.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30)
    snap = pending.wait(timeout=120)
    assert snap.read_object("s")["phase"] == 1


def test_a_job_the_helper_cannot_decode_fails_alone(
    offloading: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a job carries, one the helper cannot decode is that job's error: the helper
    goes on with the next (before, the decoding error ended its loop and it died)."""
    monkeypatch.setattr(Phase, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "Phase", Phase, raising=False)
    helper = offload.helper_for(offloading.repository)
    helper.start()
    pid = helper.pid
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        reply = helper.send({"open": {}, "phase": Phase.WARMUP}, fd).result(timeout=120)
    finally:
        os.close(fd)
    assert isinstance(reply["error"], AttributeError), reply
    state = ckstore.StateDict(w=torch.randn(64, 64))
    snap = offloading.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30).wait(120)
    assert snap.step == 1 and helper.pid == pid
