"""SQLite and ``fork``: no thread of this process is inside SQLite while it forks.

SQLite keeps process-wide mutexes (its allocator's, the list of open files' locks). A process
that forks while one of its threads holds one gives the child that mutex held by a thread the
child does not have: the child's first SQLite call (any connection, ckstore's or not) waits
forever. That is what a training job meets when it forks (DataLoader workers, a launcher that
forks its ranks) while a ckstore thread works the index: the compaction or gc behind a take,
an ``async_take``'s commit, another thread's ``log``. Measured before this gate: 43 of 100
children forked beside two threads reading an index hung in their first ``sqlite3.connect``.

Every SQLite use of ``ckstore.index`` runs inside :func:`sqlite_work`. Before a fork (an
``os.register_at_fork`` hook), the forking thread closes the gate, waits until no other thread
is inside, and opens it again after the fork, in the parent and in the child; threads that
come meanwhile wait at the gate (two threads forking at once each keep it closed until their
own fork is done). A thread inside never waits for the gate (nested use, or a fork from inside
a transaction). The wait is bounded (:data:`FORK_WAIT_S`: a transaction waiting for another
process's write lock holds no process-wide mutex, yet counts as inside); past it the fork goes
on, with a warning naming the threads still inside, and later forks do not wait for those
threads again until they left. An interrupt (Ctrl-C) during the wait ends it; the fork goes on
and the interrupt is raised again in the parent's main thread after it.

Only ckstore's own SQLite use passes the gate: another library's thread inside SQLite at a
fork is that library's hazard.
"""

from __future__ import annotations

# Hooks registered earlier run later before a fork: these modules' own hooks (executors'
# shutdown lock, logging's lock) must run after this one's wait, or a thread inside the gate
# that submits work or logs would wait for the fork that waits for it.
import _thread
import concurrent.futures.thread  # noqa: F401 - imported for the order of fork hooks
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("ckstore")

FORK_WAIT_S = 10.0
"""How long a fork waits for other threads to leave SQLite before it goes on regardless."""


class _Gate:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.inside: Counter[int] = Counter()  # thread ident -> depth
        self.forking: Counter[int] = Counter()  # threads forking now
        self.given_up: set[int] = set()  # inside when a fork stopped waiting for them
        self.interrupted = False


_GATE = _Gate()


@contextmanager
def sqlite_work() -> Iterator[None]:
    """Mark the calling thread as inside SQLite for the block (reentrant); waits while
    another thread forks."""
    gate, me = _GATE, threading.get_ident()
    with gate.cond:
        while not gate.inside[me] and any(t != me for t in gate.forking):
            gate.cond.wait()
        gate.inside[me] += 1
    try:
        yield
    finally:
        gate = _GATE  # a fork inside the block made the child a gate of its own
        with gate.cond:
            gate.inside[me] -= 1
            if gate.inside[me] <= 0:
                del gate.inside[me]
                gate.given_up.discard(me)
                gate.cond.notify_all()


def others_inside() -> list[int]:
    """The idents of threads other than the caller inside :func:`sqlite_work` now."""
    me = threading.get_ident()
    with _GATE.cond:
        return [t for t in _GATE.inside if t != me]


def _waited_for(gate: _Gate, me: int) -> list[int]:
    return [t for t in gate.inside if t != me and t not in gate.given_up]


def _before_fork() -> None:
    gate, me = _GATE, threading.get_ident()
    gate.cond.acquire()  # held through the fork: released by the hooks after it
    gate.forking[me] += 1
    deadline = time.monotonic() + FORK_WAIT_S
    try:
        while _waited_for(gate, me):
            left = deadline - time.monotonic()
            if left <= 0:
                _give_up(gate, me)
                break
            gate.cond.wait(left)
    except KeyboardInterrupt:  # a fork hook cannot raise: raised again after the fork
        gate.interrupted = True


def _give_up(gate: _Gate, me: int) -> None:
    still = _waited_for(gate, me)
    gate.given_up.update(still)
    names = {t.ident: t.name for t in threading.enumerate()}
    log.warning(
        "ckstore: forking while thread(s) %s still use the store's SQLite index (waited %.0f "
        "s); the child's SQLite calls may hang",
        ", ".join(names.get(t, str(t)) for t in still),
        FORK_WAIT_S,
    )


def _after_fork_in_parent() -> None:
    gate, me = _GATE, threading.get_ident()
    gate.forking[me] -= 1
    if gate.forking[me] <= 0:
        del gate.forking[me]
    interrupted, gate.interrupted = gate.interrupted, False
    gate.cond.notify_all()
    gate.cond.release()
    if interrupted:
        _thread.interrupt_main()


def _after_fork_in_child() -> None:
    """Only the forking thread exists here: the gate starts anew with its own depth."""
    global _GATE
    old, me = _GATE, threading.get_ident()
    fresh = _Gate()
    if old.inside[me]:
        fresh.inside[me] = old.inside[me]
    _GATE = fresh


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
