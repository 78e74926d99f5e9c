"""The write-backs a store handle owes: run behind the caller, in order; awaited by key or all;
a failure warned at close, never raised into anyone's work; a forked child owes none."""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import Future
from typing import Any

import pytest

import ckstore
from ckstore.engine import write_backs
from ckstore.engine.write_backs import WriteBacks


def test_wait_by_key_waits_for_the_jobs_that_write_it_only() -> None:
    backs = WriteBacks("file:///store")
    gate, ran = threading.Event(), []
    backs.submit(["a"], lambda: ran.append("a"), "a")
    backs.submit(["b"], lambda: (gate.wait(30), ran.append("b")), "b")
    backs.wait(["a"])
    assert ran == ["a"] and backs.pending(["b"]) and not backs.pending(["a"])
    assert backs.submitted(["a"]) and not backs.submitted(["c"])
    gate.set()
    backs.wait()
    assert ran == ["a", "b"] and not backs.pending()
    backs.close()


def test_a_failed_job_is_warned_at_close_and_never_raised() -> None:
    backs = WriteBacks("file:///store")

    def broken() -> None:
        raise ckstore.NoSpaceError("the disk is full")

    backs.submit(["a"], broken, "snapshot r@1: 1 chunk(s) healed from tier (aaaa)")
    backs.wait()  # waiting raises nothing
    with pytest.warns(ckstore.WriteBackWarning, match=r"file:///store.*r@1.*aaaa.*disk is full"):
        backs.close()


def test_after_close_a_job_runs_on_the_caller_thread() -> None:
    backs = WriteBacks("file:///store")
    backs.close()
    ran: list[str] = []
    backs.submit(["a"], lambda: ran.append(threading.current_thread().name), "a")
    assert ran == [threading.current_thread().name]


def _child_pending(backs: WriteBacks, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(backs.pending())
    backs.close()


def test_a_forked_child_owes_none_of_the_parents_write_backs() -> None:
    backs = WriteBacks("file:///store")
    gate = threading.Event()
    backs.submit(["a"], lambda: gate.wait(30), "a")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_pending, args=(backs, out))
    child.start()
    assert out.get(timeout=60) is False
    child.join(60)
    assert child.exitcode == 0
    gate.set()
    backs.close()


class _Instant:
    """An executor whose jobs are done before ``submit`` returns (a worker that wins the race)."""

    def submit(self, fn: Any, *args: Any) -> Future[None]:
        fut: Future[None] = Future()
        fn(*args)
        fut.set_result(None)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_a_job_done_before_submit_returns_does_not_hang_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(write_backs, "polite_pool", lambda *a: _Instant())
    backs = WriteBacks("file:///store")
    ran: list[int] = []
    worker = threading.Thread(target=lambda: backs.submit(["a"], lambda: ran.append(1), "a"))
    worker.daemon = True  # were it stuck, it must not hold the test run up
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "submit hung on a job already done"
    assert ran == [1] and not backs.pending()
    backs.close()
