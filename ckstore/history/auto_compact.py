"""Compaction behind training: :class:`AutoCompactor` runs
:func:`~ckstore.history.compact.compact` in a background thread after takes (``git gc
--auto``), pausing while this process takes or restores, at the lowest CPU priority; with the
knob ``background_process`` on, that thread has a helper process compact
(``compact_process.py``), so compaction shares no GIL with the training thread. The same
thread gives back, after the compaction due, what a training job's own purges freed
(:meth:`AutoCompactor.reclaim`), so a trainer's save does not wait for a gc.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine import lease
from ..engine.background import lower_priority
from ..index import SnapshotRecord
from .defaults import DEFAULT_KEEP_LOOSE

if TYPE_CHECKING:
    from types import ModuleType

    from ..engine.repository import Repository
    from .compact import CompactReport

log = logging.getLogger("ckstore")
_LOOSE = "its loose chunks stay loose until the next compaction (`ckstore compact`)"
_GRACE = "the space stays used until a later gc (`ckstore gc`)"


class _CompactThread(threading.Thread):
    """The background compaction's daemon thread, with the ``stop()`` that frameworks which
    police the threads a test leaves behind call on a daemon thread (Lightning's test suite):
    it lets the running compaction finish and ends the thread (:meth:`AutoCompactor.quiesce`)."""

    def __init__(self, loop: Callable[[], None], quiesce: Callable[[], bool]) -> None:
        super().__init__(target=loop, name="ckstore-compact", daemon=True)
        self._quiesce = quiesce

    def stop(self) -> None:
        """End the thread once the compaction it runs finished (the next take starts another)."""
        self._quiesce()


class AutoCompactor:
    """Compaction in a background thread, started by :meth:`kick` after takes (``git gc --auto``).

    One thread per repository handle, started on first use; a kick while it runs makes it run
    once more afterwards. It waits while the repository is busy (a take or restore of this
    process runs: ``Repository.busy``), so it does not slow the training job's own calls.
    Failures are logged (logger ``"ckstore"``), never raised: the loose chunks simply stay loose.
    """

    def __init__(self, repo: Repository, keep_loose: int = DEFAULT_KEEP_LOOSE) -> None:
        self._repo = repo
        self.keep_loose = keep_loose
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._due = threading.Lock()  # the two flags below (quiesce holds _lock while it waits)
        self._compact_due = False
        self._reclaim: Callable[[], object] | None = None
        self.last: CompactReport | None = None
        _COMPACTORS.add(self)

    def _after_fork_in_child(self) -> None:
        """In a child forked from the process that owns this compactor: its thread, the jobs
        due on it and the locks it may have held are the parent's. Start idle, with no thread
        (the next kick starts one here); before, the child's ``compact()``, ``gc()`` after a
        delete and ``wait_compacted()`` waited forever for the parent's thread."""
        stopped = self._stop.is_set()
        self._wake, self._stop, self._idle = threading.Event(), threading.Event(), threading.Event()
        if stopped:
            self._stop.set()
        self._idle.set()
        self._thread = None
        self._lock, self._due = threading.Lock(), threading.Lock()
        self._compact_due, self._reclaim = False, None

    def kick(self) -> None:
        """Ask for a compaction soon (starts the thread on first use)."""
        self._wake_for(compact=True)

    def reclaim(self, gc: Callable[[], object]) -> None:
        """Run ``gc`` on this thread soon, after the compaction due (at its low priority,
        pausing nothing): a training job's purge given back behind it. Calls made before it
        ran run it once (the latest ``gc``). Failures are logged, as compaction's;
        :meth:`wait_idle` waits for it too."""
        with self._due:
            self._reclaim = gc
        self._wake_for(compact=False)

    def on_own_thread(self) -> bool:
        """True when called from this compactor's thread (a ``reclaim`` job)."""
        return self._thread is not None and self._thread is threading.current_thread()

    def _wake_for(self, compact: bool) -> None:
        _modules()  # imported here, never first on the lowered thread
        with self._lock:
            if self._stop.is_set():
                return
            with self._due:
                self._compact_due = self._compact_due or compact
            self._idle.clear()
            self._wake.set()
            if self._thread is None:
                self._thread = _CompactThread(self._loop, self.quiesce)
                self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no compaction is running or asked for; False on timeout."""
        return self._idle.wait(timeout)

    def quiesce(self, timeout: float | None = None) -> bool:
        """Let a running compaction finish, then end the thread; False on timeout (it runs on).

        A later :meth:`kick` starts a new thread. For a framework's teardown that checks that
        no thread outlives it (Lightning's).
        """
        with self._lock:
            if self._stop.is_set():  # closed: the thread ends (or ended) by itself
                thread = self._thread
                if thread is not None and thread is not threading.current_thread():
                    thread.join(timeout)
                return thread is None or not thread.is_alive()
            if not self._idle.wait(timeout):
                return False
            thread, self._thread = self._thread, None
            if thread is not None and thread is not threading.current_thread():
                self._stop.set()
                self._wake.set()
                thread.join()
                self._stop.clear()
                self._wake.clear()
            return True

    def close(self) -> None:
        """Stop after the pack being written is switched (idempotent)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        lower_priority()  # behind training (engine/background.py)
        while True:
            self._wake.wait()
            if self._stop.is_set():
                self._idle.set()
                return
            self._wake.clear()
            with self._due:
                compact_due, self._compact_due = self._compact_due, False
                reclaim, self._reclaim = self._reclaim, None
            if compact_due and not self._run(self._compact_pending, "compaction", _LOOSE):
                return
            if reclaim is not None and not self._run(reclaim, "gc", _GRACE):
                return
            if not self._wake.is_set():
                if not self._repo.auto_compact and self._retire():
                    return
                self._idle.set()

    def _retire(self) -> bool:
        """End this thread, idle, when no take will kick it (auto-compaction off: it ran a
        :meth:`reclaim`); the next one starts another. False, and it stays, when someone holds
        the lock (a kick, or :meth:`quiesce` waiting for it to go idle)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._wake.is_set() or self._thread is not threading.current_thread():
                return False
            self._thread = None
            self._idle.set()
            return True
        finally:
            self._lock.release()

    def _run(self, job: Callable[[], object], what: str, then: str) -> bool:
        """Run one background job; False when the interpreter is exiting (the thread ends)."""
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - nothing is lost; the next kick retries
            if _interpreter_exiting(exc):  # a script ended without closing its store
                self._idle.set()
                return False
            log.warning(
                "ckstore: background %s of %s failed (%s: %s); %s",
                what,
                self._repo.url,
                type(exc).__name__,
                exc,
                then,
            )
        return True

    def _compact_pending(self) -> None:
        young = self._repo.deletion_ages.young()
        if _modules()[0].loose_pending(self._repo, self.keep_loose, young):
            self.last = self._compact(young)

    def _compact(self, young: set[str]) -> CompactReport:
        """One compaction behind training, leaving loose the snapshots ``young`` names too
        (what this process's deletions show its retention is about to drop): in the helper
        process where the knob ``background_process`` asks for it (``compact_process.py``),
        else on this thread."""
        compact, compact_process = _modules()
        if compact_process.in_helper(self._repo):
            return compact.CompactReport(
                **compact_process.compact_in_helper(
                    self._repo, self.keep_loose, self._repo.busy, self._stop.is_set, young
                )
            )
        return compact.compact(
            self._repo,
            keep_loose=self.keep_loose,
            pause=self._repo.busy,
            stop=self._stop.is_set,
            young=young,
        )


def _modules() -> tuple[ModuleType, ModuleType]:
    """``history.compact`` and ``compact_process``, imported by the thread that first asks for
    a compaction (a take's): opening a store (a resume) loads neither, and the lowered thread
    never holds an import's lock that a foreground import would wait on."""
    from . import compact, compact_process

    return compact, compact_process


def _interpreter_exiting(exc: BaseException) -> bool:
    """True for the error the pools raise once the interpreter is exiting (a script that ends
    without closing its store, as one opened by a ``ckstore://`` id of ``dcp.save``), and for
    any failure once the process ended its sessions at exit (the compaction's next write then
    fails its lease check): the compaction stops there, as it would when killed, and its chunks
    stay loose, which is safe and not worth a warning on the way out."""
    import concurrent.futures.thread as pools

    shutdown = isinstance(exc, RuntimeError) and "interpreter shutdown" in str(exc)
    # the pools stopped for the exit: a failure that followed (a pack pipeline closed by the
    # first one, whose own error said "after shutdown") is the same stop
    return shutdown or bool(getattr(pools, "_shutdown", False)) or lease.exiting()


def attach(repo: Repository, keep_loose: int = DEFAULT_KEEP_LOOSE) -> AutoCompactor:
    """Give ``repo`` an :class:`AutoCompactor`: kicked after each snapshot a take of this process
    commits while ``repo.auto_compact`` is on, stopped when the repository closes."""
    compactor = AutoCompactor(repo, keep_loose)

    def after(record: SnapshotRecord) -> None:
        if repo.auto_compact:
            compactor.kick()

    repo.after_commit.append(after)
    repo.before_close.append(compactor.close)
    return compactor


_COMPACTORS: weakref.WeakSet[AutoCompactor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for compactor in list(_COMPACTORS):
        compactor._after_fork_in_child()  # noqa: SLF001 - the class's own fork hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
