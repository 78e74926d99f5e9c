"""The two-tier store: takes commit locally; a background thread pushes them to the remote.

``ckstore.open(path, push_to=NAME)`` makes the remote the store's *persistent tier*
(``remotes.tier`` in the index, so every later process knows it too) and attaches an
:class:`Uploader`. After every snapshot a take of this process commits (the repository's
``after_commit`` hook, beside the background compaction's) it pushes every snapshot the remote
does not hold yet, in commit order, with the tags, and then, with a ``local_budget``, evicts
least recently used pushed packs (:mod:`.evict`). While a take or restore of this process runs
(``Repository.busy``) it waits between reads, so the training job's own calls keep the disk and
the CPU; the take itself never waits for the remote.

How pushing and compaction meet: a take writes loose packs (the fast codec); compaction
rewrites older snapshots densely once newer ones exist. The uploader pushes each snapshot as it
is stored at that moment, payload for payload (no encoding on the way), so the newest snapshot
usually travels in its loose form and older ones (if they were never pushed) in their dense
one; the remote marks what arrived loose as loose, and its own compaction (``ckstore compact``
run there, or its own takes) densifies it. A chunk compacted here after it was pushed is never
sent again: the remote is asked by chunk id, and ids never change. A chunk compaction moves
while it is being pushed is looked up again and sent from its new place.

Retention and gc (:mod:`ckstore.history.gc`) keep every snapshot a tier does not hold yet
(``Index.unpushed_to_tiers``), so nothing only the local tier has is ever deleted by a policy.
A push that fails (the remote unreachable, missing, or another store at its URL: it is never
created anew once used, :mod:`.config`) is retried with a growing delay, up to a minute, and
evicts nothing; each round first shows that the remote it holds open is still there;
:meth:`Uploader.wait` raises its error, and :meth:`Uploader.close` (a clean ``close()`` of the
store) waits for what is pending, or, when pushing keeps failing, logs what is left unpushed:
it stays local, kept by gc, and the next store opened with ``push_to`` pushes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from ..engine.repository import describe
from ..errors import CkstoreError
from ..index import SnapshotRecord
from .evict import EvictReport, evict
from .select import Selection
from .tier import RemoteHandle, TierBackend
from .transfer import TransferReport, transfer

if TYPE_CHECKING:
    from ..engine.interfaces import RemoteIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")

RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Delays before retrying a push that failed (the last one repeats)."""
CLOSE_ATTEMPTS = 3
"""Failed pushes in a row after which a closing store stops waiting (what is left stays local)."""


class Uploader:
    """Pushes what the tier remote lacks, in a background thread (module docstring)."""

    def __init__(
        self, local: Repository, remote: RemoteHandle, tier: TierBackend, budget: int | None = None
    ) -> None:
        self._local, self._remote, self._tier, self.budget = local, remote, tier, budget
        self._index: RemoteIndex = local.index
        self._cond = threading.Condition()
        self._wanted = False
        self._running = False
        self._closing = False
        self._failures = 0
        self._failed_rounds = 0  # every failed push so far (``_failures`` restarts on success)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """The last push's failure; None once a push succeeded."""
        self.last: TransferReport | None = None
        self.last_eviction: EvictReport | None = None
        self.pushing: set[str] = set()
        """Ids of the snapshots the push under way is sending."""
        _UPLOADERS.add(self)

    def _forked(self) -> None:
        """A forked child has no push thread of its parent's (its close waited for it, which
        never ran there, forever), and pushes nothing itself (locks a thread of the parent held
        at the fork would hang it): what it commits is in the index, and goes with the parent's
        next push, or the next store opened with ``push_to``."""
        self._cond = threading.Condition()
        self._thread, self._running, self._wanted, self._closing = None, False, False, True
        self.pushing = set()

    @property
    def name(self) -> str:
        return self._remote.name

    def kick(self) -> None:
        """Ask for a push soon (starts the thread on first use)."""
        with self._cond:
            if self._closing:
                return
            self._wanted = True
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ckstore-push", daemon=True)
                self._thread.start()

    def pending(self) -> list[SnapshotRecord]:
        """Snapshots the remote does not hold yet (in the order they will go)."""
        return self._index.unpushed(self.name)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every snapshot committed here is pushed; False on timeout.

        Raises:
            CkstoreError (StorageError, IndexError_, ...): the latest push failed (it is
                retried in the background; the message names the remote).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            seen = self._failed_rounds
        self.kick()
        with self._cond:
            while True:
                # a push that failed since this call began is its answer, though a retry may
                # already be due or under way: the retries of a remote that stays away (quick
                # ones, on a busy machine) can leave no moment with nothing wanted or running
                if self.error is not None and self._failed_rounds > seen:
                    raise self.error
                if not self._wanted and not self._running:
                    if self.error is not None:
                        raise self.error
                    if not self.pending():
                        return True
                    if self._closing:  # closed, or a forked child's: nothing pushes here
                        return False
                    self._wanted = True  # committed meanwhile by another process: once more
                    self._cond.notify_all()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def close(self) -> None:
        """Push what is pending, then stop (a push that keeps failing is given up after
        :data:`CLOSE_ATTEMPTS` tries: what is left stays local, logged, and goes next time)."""
        with self._cond:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            while True:
                try:
                    if self.wait():
                        break
                except CkstoreError:
                    if self._failures >= CLOSE_ATTEMPTS:
                        left = self.pending()
                        log.warning(
                            "ckstore: %d snapshot(s) of %s were not pushed to remote %r (%s); they stay "
                            "local (gc keeps them) and go with the next push: %s",
                            len(left),
                            self._local.url,
                            self.name,
                            self.error,
                            ", ".join(describe(s) for s in left[:5]),
                        )
                        break
                    self._retry_now()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._remote.close()

    def _retry_now(self) -> None:
        with self._cond:
            self.error = None
            self._wanted = True
            self._cond.notify_all()

    # --- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                self._wanted = False
                self._running = True
            try:
                self._round()
                with self._cond:
                    self.error, self._failures = None, 0
            except Exception as exc:  # noqa: BLE001 - reported by wait(), retried below
                self._failed(exc)
            finally:
                with self._cond:
                    self._running = False
                    self.pushing = set()
                    self._cond.notify_all()

    def _round(self) -> None:
        self._while_busy()
        todo = self.pending()
        if todo:
            remote = self._remote.get(create=True, fresh=True)
            tags = {t.name: t.snapshot_id for t in self._index.list_tags()}
            self.pushing = {s.id for s in todo}
            self.last = transfer(
                self._local,
                remote,
                Selection(todo, tags),
                direction="push",
                remote=self.name,
                force=True,
                pause=self._local.busy,
                record=lambda ids: self._index.mark_pushed(self.name, ids),
            )
        if self.budget is not None:
            remote = self._remote.get(fresh=True)
            self.last_eviction, packs = evict(
                self._local, remote, self.name, self.budget, self._tier.take_used()
            )
            self._tier.evicted(packs)

    def _while_busy(self) -> None:
        """Wait while a take or restore of this process runs (the hook that kicked this round runs
        inside the take, before it returns): opening the remote and asking its index would take
        CPU from the take's last steps."""
        while self._local.busy() and not self._closing:
            time.sleep(0.01)

    def _failed(self, exc: BaseException) -> None:
        self._remote.reset()
        with self._cond:
            self.error = exc if isinstance(exc, CkstoreError) else _wrap(exc, self.name)
            self._failures += 1
            self._failed_rounds += 1
            delay = RETRY_SECONDS[min(self._failures, len(RETRY_SECONDS)) - 1]
        log.warning(
            "ckstore: pushing %s to remote %r failed (%s: %s); retrying in %.1f s",
            self._local.url,
            self.name,
            type(exc).__name__,
            exc,
            delay,
        )
        timer = threading.Timer(delay, self._retry_if_open)
        timer.daemon = True
        timer.start()

    def _retry_if_open(self) -> None:
        with self._cond:
            if not self._closing:
                self._wanted = True
                self._cond.notify_all()


def _wrap(exc: BaseException, name: str) -> CkstoreError:
    from ..errors import StorageError

    err = StorageError(f"pushing to remote {name!r} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


_UPLOADERS: weakref.WeakSet[Uploader] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for uploader in list(_UPLOADERS):
        uploader._forked()  # noqa: SLF001 - the class's own fork hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
