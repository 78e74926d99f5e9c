"""Async takes in flight in this process: a store's ``close`` and the interpreter's exit wait
for them.

An ``async_take`` returns once its state is staged; its thread hashes, writes and commits
behind training. A script whose last lines start the final checkpoint and end (falling off its
end, ``sys.exit(0)``, ``store.close()`` first) used to lose it without a word: at exit the
interpreter stops every thread pool before it joins the take's thread, so the take's next
step failed, and nobody was left to read the error. Now:

- ``Store.close`` (:func:`close_waits`) waits for the handle's takes in flight, and warns
  (``RuntimeWarning``) naming each that failed and so was not committed;
- an exit hook, run before the thread pools stop (``threading._register_atexit``: its hooks
  run last registered first, and this module registers after ``concurrent.futures``' own),
  waits for every take still in flight, saying on stderr which it waits for, and which failed.

A process killed (SIGKILL, a lost node) commits nothing of a take in flight, as ever: it is
all or nothing (docs/RELIABILITY.md, I1).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook registered before ours (above)
import os
import sys
import threading
import warnings
from concurrent.futures import Future
from typing import Any

_lock = threading.Lock()
_inflight: dict[Future[Any], tuple[int, str]] = {}
"""Each take in flight -> (id of its repository, what it takes: ``run@step``)."""


def track(repo: object, future: Future[Any], label: str) -> None:
    """Remember an async take of ``repo`` until its future is done."""
    with _lock:
        _inflight[future] = (id(repo), label)
    future.add_done_callback(_forget)


def _forget(future: Future[Any]) -> None:
    with _lock:
        _inflight.pop(future, None)


def _pending(repo: object | None) -> list[tuple[Future[Any], str]]:
    with _lock:
        return [(f, label) for f, (r, label) in _inflight.items() if repo is None or r == id(repo)]


def wait_for(repo: object | None = None) -> list[tuple[str, BaseException]]:
    """Wait for the async takes of ``repo`` in flight (None: every one); the ``(run@step,
    error)`` of each that failed."""
    failed = []
    for future, label in _pending(repo):
        exc = future.exception()
        if exc is not None:
            failed.append((label, exc))
    return failed


def close_waits(repo: object) -> None:
    """What ``Store.close`` does first: wait for the handle's async takes, warn of failures."""
    for label, exc in wait_for(repo):
        warnings.warn(
            f"ckstore: the async take of {label} in flight at close failed and was not "
            f"committed ({type(exc).__name__}: {exc})",
            RuntimeWarning,
            stacklevel=3,
        )


def _at_exit() -> None:
    pending = _pending(None)
    if not pending:
        return
    labels = ", ".join(label for _, label in pending)
    print(
        f"ckstore: waiting for {len(pending)} async take(s) in flight to commit before the "
        f"process exits: {labels}",
        file=sys.stderr,
        flush=True,
    )
    for label, exc in wait_for(None):
        print(
            f"ckstore: the async take of {label} failed and was not committed "
            f"({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a ``multiprocessing`` fork) has none of its
    parent's take threads: their futures never complete there, so waiting for them at the
    child's exit (``multiprocessing`` runs the threading exit hooks too) or at its
    ``close`` would hang it forever. The parent still waits for them."""
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _inflight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_register = getattr(threading, "_register_atexit", None)
if _register is not None:  # CPython 3.9+; elsewhere the non-daemon take threads are joined
    _register(_at_exit)
