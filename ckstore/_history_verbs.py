"""The store's history verbs: diff, gc, check, compaction and reindex.

:class:`HistoryVerbs` is mixed into :class:`ckstore.Store` (as :class:`ckstore._remote_verbs.RemoteVerbs`
is); the work is in :mod:`ckstore.history`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .engine.progress import ProgressFn
from .errors import InvalidInputError
from .history.defaults import DEFAULT_GRACE_SECONDS, DEFAULT_KEEP_LOOSE, DEFAULT_REPACK_BELOW

if TYPE_CHECKING:  # the verbs import their modules when called: a resume loads none of them
    from .engine.repository import Repository
    from .history.auto_compact import AutoCompactor
    from .history.check import CheckReport
    from .history.compact import CompactReport
    from .history.diff import DiffResult
    from .history.gc import GCReport
    from .history.reindex import ReindexReport


class HistoryVerbs:
    """Compare, retain, verify, compact and rebuild a store (docs/USAGE.md)."""

    _repo: Repository
    _compactor: AutoCompactor
    _purged: set[str]

    def diff(self, a: str, b: str, numeric: bool = False) -> DiffResult:
        """Compare two snapshots key by key.

        Which keys were added, removed, changed or kept, and for a changed tensor how many of
        its chunks changed, come from the index alone. ``numeric=True`` also reads the changed
        chunks of both sides (verified) and summarises how far apart the values are.

        Raises:
            SnapshotNotFoundError: ``a`` or ``b`` names nothing.
            CorruptionError: a manifest or (with ``numeric``) a chunk read is damaged.
        """
        from .history.diff import diff as history_diff

        return history_diff(self._repo, a, b, numeric=numeric)

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_tagged: bool = True,
        older_than: float | None = None,
        runs: Sequence[str] | None = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        repack_below: float = DEFAULT_REPACK_BELOW,
        dry_run: bool = False,
        keep_healthy: bool = True,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        progress: ProgressFn | None = None,
    ) -> GCReport:
        """Forget the snapshots a retention policy drops, then prune what nothing references.

        Args:
            keep_last: keep the N newest snapshots of each run.
            keep_every_steps: keep snapshots whose step is a multiple of N.
            keep_tagged: keep every tagged snapshot.
            keep_healthy: keep each run's newest healthy snapshot (recorded free of NaN and
                Inf, of stale tensors and of replicas that disagree), whatever the other rules
                say, so ``run@healthy`` survives a run going wrong; False lets the other rules
                drop it.
            keep_best: keep the N best snapshots of each run by the metadata value ``metric``
                (as Lightning's ``save_top_k``); snapshots without it are not ranked.
            metric: the metadata key ``keep_best`` ranks by (``"loss"``; ``"eval.loss"`` reaches
                into a nested object).
            mode: ``"min"`` (lower is better, the default) or ``"max"``.
            older_than: only snapshots older than this many seconds may be dropped.
            runs: only snapshots of these runs may be dropped (None: every run).
            grace_seconds: unreferenced data younger than this, and packs retired more
                recently, are kept (a reader or writer may still be using them).
            repack_below: rewrite packs whose live bytes fell below this fraction (0: never).
            dry_run: report what would happen, change nothing.
            progress: ``fn("gc", done, total)`` told the live bytes copied out of sparse packs
                as they are rewritten (the long part of a gc), as for :meth:`take`.

        With none of ``keep_last``, ``keep_every_steps``, ``older_than``, ``keep_best`` set no
        snapshot is dropped and gc only prunes. A snapshot is dropped when no rule keeps it:
        ``keep_best=3, metric="loss", keep_last=1`` keeps the three lowest losses and the
        newest. Safe beside live takes (see docs/RELIABILITY.md, I4). Never drops the only
        durable copy of a snapshot: on a two-tier store, one its tier remote does not hold yet
        (a pending push), or that the remote was not shown to hold now (its index lost it:
        forgotten there, pushed again; the remote cannot be opened: kept until it can).

        What only the snapshots this handle deleted (:meth:`delete`, :meth:`delete_run`) used
        is reclaimed at once, without the grace period, when no write session is alive
        (after this handle's background compaction finished): a training job that purges its
        old checkpoints gets the disk back within the job (``report.purged_now``). With a take
        or push of any process running, it waits for the grace period like the rest.

        Raises:
            InvalidInputError: an option is out of range (e.g. a negative grace period); nothing
                changed.
        """
        if isinstance(runs, str):
            raise InvalidInputError(
                f"gc: runs must be a list of run names, got the string {runs!r}"
            )
        purged = frozenset(self._purged)
        if purged and not dry_run and not self._compactor.on_own_thread():
            self._compactor.wait_idle()  # this handle's own writer: let it finish first
        from .history.gc import gc as history_gc
        from .remote.holdings import unproven, unshown

        report = history_gc(
            self._repo,
            keep=unproven(self._repo, forget=not dry_run),
            unshown=partial(unshown, self._repo),
            keep_last=keep_last,
            keep_every_steps=keep_every_steps,
            keep_tagged=keep_tagged,
            older_than=older_than,
            runs=tuple(runs) if runs is not None else None,
            grace_seconds=grace_seconds,
            repack_below=repack_below,
            dry_run=dry_run,
            keep_healthy=keep_healthy,
            keep_best=keep_best,
            metric=metric,
            mode=mode,
            progress=progress,
            purged=frozenset() if dry_run else purged,
        )
        if not dry_run and not report.sessions_held:
            self._purged -= purged  # reclaimed (or still used by a snapshot kept)
        return report

    def check(
        self,
        read_data: bool | float = False,
        progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    ) -> CheckReport:
        """Verify the store's integrity: manifests, references, packs against the index.

        ``read_data`` True also reads every pack whole: its bytes must hash to its name
        (header, trailer and footer) and every chunk in it to its id. A number in [0, 1] reads
        that share of the packs, at least one when above 0. The report says how much was read
        (``packs_read``, ``chunks_read``, ``bytes_read``). ``progress`` wraps the per-pack loop
        of the data pass.

        Raises:
            InvalidInputError: ``read_data`` is not a bool or a number in [0, 1].
        """
        from .history.check import check as history_check

        return history_check(self._repo, read_data=read_data, progress=progress)

    def compact(
        self,
        *,
        keep_loose: int = DEFAULT_KEEP_LOOSE,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> CompactReport:
        """Rewrite older snapshots' loose chunks densely, now (``git gc`` for loose objects).

        A take writes new chunks loose (a fast codec, no deltas). This rewrites those that no
        run's ``keep_loose`` newest snapshots use: byte-grouped zstd, or an XOR delta against
        the chunk at the same place in the snapshot's parent when that is smaller (chains bounded
        by ``delta_depth``). Safe beside takes, restores and gc in any process; crash-safe at
        every step (docs/RELIABILITY.md). Takes also start it in the background by themselves
        (``auto_compact``); this waits for a background run first. ``progress`` is called with
        the raw bytes of each chunk rewritten.

        Raises:
            InvalidInputError: ``keep_loose`` is not an int >= 0.
            LeaseExpiredError: the compaction stalled past its lease (what it switched stays).
        """
        from .format.limits import check_int

        check_int("keep_loose", keep_loose)
        self._compactor.wait_idle()
        from .history.compact import compact as history_compact

        return history_compact(
            self._repo, keep_loose=keep_loose, dry_run=dry_run, progress=progress
        )

    def reclaim_behind(self) -> None:
        """Give back what this handle's deletions freed (:meth:`gc` with no policy: at once when
        no write session is alive, else after the grace period), behind the caller: on the
        background compaction's thread, after any compaction due, at the lowest CPU priority.

        For a training job's own purges (the integrations' retention): a save that deleted the
        checkpoints the trainer dropped returns without waiting for the gc (which waits for
        the compaction, then may rewrite sparse packs). Errors are logged (logger
        ``"ckstore"``), never raised; :meth:`wait_compacted` waits for it; closing the store
        lets a running one finish.
        """
        self._compactor.reclaim(self.gc)

    def wait_compacted(self, timeout: float | None = None) -> bool:
        """Wait until no background compaction (or :meth:`reclaim_behind`) of this handle runs
        or is due; False on timeout."""
        return self._compactor.wait_idle(timeout)

    def quiesce(self, timeout: float | None = None) -> bool:
        """Wait for this handle's background compaction to finish and end its thread.

        The store stays open and usable; the next take starts the thread again. For code that
        checks that no thread outlives it (a trainer's teardown). False on timeout.
        """
        return self._compactor.quiesce(timeout)

    @property
    def last_compaction(self) -> CompactReport | None:
        """What this handle's last background compaction did (None before one ran)."""
        return self._compactor.last

    def reindex(self) -> ReindexReport:
        """Rebuild this store's empty index from its packs and manifests (I5)."""
        from .history.reindex import reindex as history_reindex

        return history_reindex(self._repo)
