"""Writes a store handle owes: durable work a read handed to a background thread.

A read that heals a damaged chunk (``remote/heal.py``) uses the chunk's verified bytes at once
and leaves writing them back into this store (a new durable pack, then the rows switched) to
:class:`WriteBacks`, the one queue of its :class:`~ckstore.engine.repository.Repository`.
Until a write-back lands, the local copy is still the damaged one and the remote still holds
the sound one: nothing is lost if the process dies meanwhile (the next read heals again).

The contract, for whoever submits work and whoever relies on it having landed:

- :meth:`WriteBacks.submit` runs a job on the handle's one background thread (at the lowest CPU
  priority, ``background.py``: the read it is behind, and training, come first), jobs in the
  order submitted. A job that raises is logged at once and remembered with the message it was
  submitted with; :meth:`WriteBacks.close` warns it (:class:`~ckstore.errors.WriteBackWarning`).
  It never raises into anyone else's work.
- :meth:`WriteBacks.wait` blocks until every job submitted before the call (of the keys asked
  about, or all) has finished, landed or failed. Anything of this process that relies on the
  local copies, or could drop the remote's, waits first: ``check``, ``gc``, compaction,
  eviction of the tier, ``push``, ``repair``, and a heal (of the same chunks: the second heal
  finds them sound instead of fetching them again).
- :meth:`WriteBacks.close` (the repository's close, before anything else closes) waits for
  every job, stops the thread and warns what failed. Work submitted after it runs on the
  caller's thread.

Another process's gc or compaction does not wait: it sees the damaged local copy, as it would
before any heal. A child forked from a process with write-backs in flight starts with none: they
are the parent's to land.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..errors import WriteBackWarning, warn
from .background import polite_pool

log = logging.getLogger("ckstore")


class WriteBacks:
    """The write-backs one store handle owes (module docstring). Thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._jobs: dict[Future[None], frozenset[str]] = {}
        self._keys: set[str] = set()  # of every job submitted in the handle's life
        self._failed: list[str] = []
        self._closed = False

    def submit(self, keys: Iterable[str], job: Callable[[], object], failed: str) -> None:
        """Run ``job`` behind the caller; ``keys`` name what it writes (the chunk ids), for
        :meth:`wait`; ``failed`` says what was not written should it raise (named in the
        warning at :meth:`close`). After :meth:`close`, ``job`` runs now, on this thread."""
        keys = frozenset(keys)
        fut: Future[None] | None = None
        with self._lock:
            self._forked()
            self._keys |= keys
            if not self._closed:
                if self._executor is None:
                    self._executor = polite_pool(1, "ckstore-writeback")
                fut = self._executor.submit(self._run, job, failed)
                self._jobs[fut] = keys
        if fut is None:
            self._run(job, failed)
        else:  # outside the lock: a job already done runs the callback here, at once
            fut.add_done_callback(self._done)

    def submitted(self, keys: Iterable[str]) -> bool:
        """Whether a job writing any of ``keys`` was submitted in this handle's life (landed,
        failed or pending): a reader that found such a chunk damaged may have located it
        before the write-back switched its row."""
        with self._lock:
            return not self._keys.isdisjoint(keys)

    def pending(self, keys: Iterable[str] | None = None) -> bool:
        """Whether a job (writing any of ``keys``; None: any) has not finished yet."""
        return bool(self._matching(keys))

    def wait(self, keys: Iterable[str] | None = None) -> None:
        """Block until every job submitted so far that writes any of ``keys`` (None: every
        job) has finished, landed or failed."""
        found = self._matching(keys)
        if found:
            wait(found)

    def close(self) -> None:
        """Wait for every job, stop the thread, and warn :class:`WriteBackWarning` naming what
        failed to land (once)."""
        with self._lock:
            self._forked()
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            warn(
                WriteBackWarning(
                    f"store {self.url}: {len(failed)} write-back(s) of healed chunks did not "
                    f"land: {'; '.join(failed)}. The local copies stay damaged and the remotes "
                    "still hold them: the next read heals them again, or run `ckstore repair`"
                )
            )

    def _forked(self) -> None:
        """In a child forked while the parent had jobs or a thread: they are the parent's (its
        thread does not exist here, nor do its jobs run here); start afresh. Under the lock."""
        if self._pid != os.getpid():
            self._pid, self._executor, self._jobs, self._failed = os.getpid(), None, {}, []

    def _matching(self, keys: Iterable[str] | None) -> list[Future[None]]:
        want = None if keys is None else set(keys)
        with self._lock:
            self._forked()
            return [f for f, k in self._jobs.items() if want is None or not k.isdisjoint(want)]

    def _run(self, job: Callable[[], object], failed: str) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - reported at close, never raised into a reader
            log.warning("ckstore: %s: %s: %s", failed, type(exc).__name__, exc)
            with self._lock:
                self._failed.append(f"{failed} ({type(exc).__name__}: {exc})")

    def _done(self, fut: Future[None]) -> None:
        with self._lock:
            self._jobs.pop(fut, None)
