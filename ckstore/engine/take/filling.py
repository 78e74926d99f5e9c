"""The copies an async take makes into its staging arena, on every core the take may use.

The training thread waits for these copies (the call returns once the state is safe), so they
run on the take's ``threads`` at once: filler threads, balanced by bytes, each with at least
:data:`FILL_SHARE` bytes (the calling thread makes them itself when they come to less than
one share), while the calling thread plans the take. On 2 cores, 270 MiB, torch on one
thread: two fillers copy in 20 ms where one thread takes 30 ms.

Tried and measured (2 cores, torch on both, a copy spread over torch's own threads): the
calling thread copying alone blocked 2.5 ms less at 270 MiB (26 against 28.5 ms) but 5-14 ms
more at 768 MiB and about 20 ms more at 2 GiB, planning beside it on a thread or not; a thread
kept for the copies made the trainer's own copies after the call slower. Fillers stay.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from typing import Any

from .staging import arena_bytes, fill

FILL_SHARE = 32 << 20
"""Bytes of copies per filler thread, at least: a smaller share is not worth a thread."""

Pairs = list[tuple[Any, Any]]
"""``(place, value)`` pairs: :meth:`StagingArena.place`'s room and the value to copy there."""


class Copies:
    """The copies of one take under way on filler threads."""

    def __init__(self) -> None:
        self.jobs: list[Future[None]] = []

    def done(self) -> bool:
        """Whether every copy has ended (made or failed)."""
        return all(job.done() for job in self.jobs)

    def join(self, quiet: bool = False) -> None:
        """Wait for every copy; re-raise the first error unless ``quiet`` (a caller raising an
        error of its own waits for the copies, then raises its own)."""
        wait(self.jobs)
        errors = [e for e in (job.exception() for job in self.jobs) if e is not None]
        if errors and not quiet:
            raise errors[0]


def start(pairs: Pairs, threads: int, into: Copies) -> None:
    """Start the copies of ``pairs`` on filler threads (each recorded in ``into`` before it
    starts: join it): up to ``threads``, one per :data:`FILL_SHARE` bytes and at least one; or
    make them here, at once, when they come to less than one share (a thread would cost more
    than it overlaps)."""
    sized = sorted(((arena_bytes(v), i) for i, (_, v) in enumerate(pairs)), reverse=True)
    total = sum(n for n, _ in sized)
    if total < FILL_SHARE:
        fill(pairs)
        return
    n = max(1, min(threads, len(pairs), total // FILL_SHARE))
    shares: list[Pairs] = [[] for _ in range(n)]
    load = [0] * n
    for size, at in sized:  # largest first, each to the least loaded thread
        i = load.index(min(load))
        shares[i].append(pairs[at])
        load[i] += size
    for share in shares:
        if share:
            _on_a_thread(share, into)


def _on_a_thread(pairs: Pairs, into: Copies) -> None:
    """Start a filler thread copying ``pairs``, its job recorded in ``into`` first."""
    job: Future[None] = Future()
    job.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fill(pairs)
        except BaseException as exc:  # noqa: BLE001 - re-raised by Copies.join()
            job.set_exception(exc)
        else:
            job.set_result(None)

    thread = threading.Thread(target=run, name="ckstore-stage", daemon=True)
    try:
        into.jobs.append(job)
        thread.start()
    except BaseException as exc:
        if thread.ident is None and not job.done():  # it never ran: nothing will end the job
            job.set_exception(exc)
        raise
