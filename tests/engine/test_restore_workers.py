"""The restore's threads over a pass of chunk jobs (``Fetcher._run``, ``restore/workers.share``).

A few tasks each take the next job as they finish one: the calling thread does not submit one
task per job while the workers hold the GIL. A failure, or an interrupt of the calling thread,
comes back only once no worker still writes into a destination.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import pytest

from ckstore import objects
from ckstore.engine.restore.fetch import Fetcher
from ckstore.engine.restore.jobs import Job


def _fetcher() -> Fetcher:
    return Fetcher(objects.ObjectStore(objects.memory_backend()), None, "test", threads=2)  # type: ignore[arg-type]


def _jobs(n: int) -> list[Job]:
    return [Job(key=f"k{i}", cid=f"c{i}", dtype="float32", sizes=(1 << 20,)) for i in range(n)]


class _Slow:
    """A job that takes ``seconds``, counting the jobs running and those done."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.running = 0
        self.done: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, job: Job) -> None:
        with self._lock:
            self.running += 1
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
            self.done.append(job.key)


def _run(
    jobs: list[Job], fn: Callable[[Job], None], after: Callable[[], None] = lambda: None
) -> None:
    """``Fetcher._run`` of ``jobs``; ``after`` is called once it returned or raised, before
    the fetcher closes (``close`` waits for its threads too)."""
    f = _fetcher()
    try:
        f._run(jobs, fn)
    finally:
        after()
        f.close()


def test_every_job_runs_once_on_at_most_the_fetchers_threads() -> None:
    jobs = _jobs(40)
    started: list[str] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def fn(job: Job) -> None:
        with lock:
            started.append(job.key)
            threads.add(threading.get_ident())
        time.sleep(0.001)

    _run(jobs, fn)
    assert sorted(started) == sorted(j.key for j in jobs) and len(started) == len(jobs)
    assert 1 <= len(threads) <= 2 and threading.get_ident() not in threads


def test_a_failure_comes_back_only_once_no_worker_still_writes() -> None:
    """The pass itself waits, not only ``Fetcher.close``: with one task per job, the first
    failure in order came back while another job was still being written on another thread."""
    jobs = _jobs(2)
    started, finished = threading.Event(), threading.Event()

    def fn(job: Job) -> None:
        if job.key == "k0":
            assert started.wait(5)
            raise ValueError("damaged")
        started.set()
        time.sleep(0.3)
        finished.set()

    seen: list[bool] = []
    with pytest.raises(ValueError, match="damaged"):
        _run(jobs, fn, after=lambda: seen.append(finished.is_set()))
    assert seen == [True]


def test_the_first_failure_in_order_is_the_one_raised() -> None:
    def fn(job: Job) -> None:
        if job.key == "k0":
            time.sleep(0.2)
            raise ValueError("k0")
        raise KeyError("k1")  # fails first in time

    with pytest.raises(ValueError, match="k0"):
        _run(_jobs(2), fn)


def _interrupt_at(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, call: int, after: float
) -> None:
    """``owner.name`` raises KeyboardInterrupt at its ``call``-th call, ``after`` seconds in
    (as a Ctrl-C landing there); the other calls go through."""
    real = getattr(owner, name)
    calls = [0]

    def patched(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == call:
            time.sleep(after)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def _interrupted(jobs: list[Job], fn: _Slow) -> list[int]:
    """Run the interrupted pass; the jobs still running when it came back, as it came back."""
    seen: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        _run(jobs, fn, after=lambda: seen.append(fn.running))
    return seen


def test_an_interrupt_of_the_calling_thread_stops_the_workers_before_it_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = _jobs(40)
    fn = _Slow(0.1)
    _interrupt_at(monkeypatch, concurrent.futures.Future, "result", 1, 0.05)  # both in a job
    assert _interrupted(jobs, fn) == [0]  # nothing still writes when the pass comes back
    assert 0 < len(fn.done) < len(jobs)  # they stopped after the job they were on


def test_an_interrupt_while_the_tasks_are_handed_out_stops_those_already_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = _jobs(40)
    fn = _Slow(0.05)
    # the second submit: the first task is inside a job
    _interrupt_at(monkeypatch, concurrent.futures.ThreadPoolExecutor, "submit", 2, 0.02)
    assert _interrupted(jobs, fn) == [0]  # the task already running stopped before it came back
    assert 0 < len(fn.done) < len(jobs)
