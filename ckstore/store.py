"""The store: what users open and call verbs on. It holds a repository (objects, index, config)
and hands out snapshot handles."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, overload

from . import _remote_verbs, _takes
from ._heal_verbs import HealVerbs
from ._history_verbs import HistoryVerbs
from ._ref_verbs import RefVerbs
from ._usage_verbs import UsageVerbs
from .engine.config import StoreConfig
from .engine.knobs import Knobs
from .engine.progress import ProgressFn
from .engine.repository import Repository
from .engine.take.spec import AsyncTakeOptions, LiveTakeOptions, TakeOptions, TakeSpec
from .engine.view import SnapshotView
from .errors import CkstoreError, LeaseExpiredError, SnapshotNotFoundError
from .format.manifest import Manifest
from .history.auto_compact import attach as attach_compaction
from .index import SnapshotRecord
from .pending import PendingSnapshot
from .snapshot import StoredSnapshot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .engine.take.local import LocalTake

RENEW_RETRY_SECONDS = 0.5
"""Pause between :meth:`Store.renew_session`'s attempts while the index is out of reach."""

T = TypeVar("T")
_REQUIRED: Any = object()
"""``Store.get`` without a default: a ref that names nothing raises."""


class Store(HistoryVerbs, HealVerbs, UsageVerbs, RefVerbs, _remote_verbs.RemoteVerbs, Knobs):
    """A content-addressed checkpoint store. Build one with :func:`ckstore.open`.

    Thread-safe for concurrent takes and reads from one process; many processes and hosts may
    share a store (the index serialises commits). The knobs ``threads``, ``io_threads``,
    ``memory_budget``, ``staging_budget``, ``lease_seconds``, ``delta_base``, ``delta_depth``,
    ``take_codec`` and ``auto_compact`` (see :class:`~ckstore.engine.knobs.Knobs`) may be set
    on an open store; they affect this process only.
    """

    def __init__(self, repository: Repository) -> None:
        Knobs.__init__(self, share=repository)
        self._repo = repository
        self._compactor = attach_compaction(repository)
        self._purged: set[str] = set()

    @property
    def repository(self) -> Repository:
        """The plumbing under the store: object store, index, config and knobs (for
        maintenance tools and tests; the verbs here are what users call)."""
        return self._repo

    @property
    def url(self) -> str:
        """The store's URL (an absolute path for a local store)."""
        return self._repo.url

    @property
    def index_url(self) -> str:
        """The URL of the store's index (its password hidden)."""
        return self._repo.index.url

    @property
    def config(self) -> StoreConfig:
        """The store's own config: format version, features, chunk and pack sizes."""
        return self._repo.config

    @property
    def read_only(self) -> bool:
        """True when this store refuses writes (opened read-only, or not writable)."""
        return self._repo.read_only

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (the handle can no longer be used)."""
        return self._repo.closed

    @property
    def opened_with(self) -> dict[str, Any]:
        """How it was opened (index URL as given, storage options), to reopen it elsewhere."""
        return self._repo.opened_with

    def _handle(self, record: SnapshotRecord, manifest: Manifest | None = None) -> StoredSnapshot:
        return StoredSnapshot(SnapshotView(self._repo, record, manifest))

    # --- writing -------------------------------------------------------------------------
    @_takes.shows(LiveTakeOptions)
    def take(
        self,
        app_state: Mapping[str, Any],
        run: str = "default",
        step: int | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        pg: ProcessGroup | None = None,
        progress: ProgressFn | None = None,
        **options: Unpack[LiveTakeOptions],
    ) -> StoredSnapshot:
        """Snapshot ``app_state`` (names -> objects with ``state_dict()``) into ``run``.

        Only chunks the store lacks are written; the snapshot becomes visible atomically when
        its index transaction commits, after its packs are durable. ``tags`` move to it in the
        same transaction. Returns the committed :class:`Snapshot` with its stats.

        With ``torch.distributed`` initialised, call it on every rank with the same arguments:
        DTensors are written shard by shard, tensors of a DistributedDataParallel module or
        with keys matching a ``replicated`` glob are written once (each rank writing about
        1/world of the bytes), and any other value is kept per rank unless it is the same on
        every rank. ``pg`` limits the take to a process group's members (ranks outside it take
        no part; per-rank values are kept by rank within ``pg``). ``dist_timeout`` (default
        ``CKSTORE_DIST_TIMEOUT`` or 600 s) bounds how long ranks wait for each other; a rank
        that never comes, dies or stops is named in a RankLostError. Any rank's failure raises
        DistributedError on every rank and commits nothing. Every rank's copy of the
        replicated tensors (a DDP module's parameters, ``replicated`` keys, a DTensor's shard
        among the ranks holding the same box) is compared by fingerprint: copies that differ are named with their ranks, keys and chunk regions in
        the snapshot's health (``snap.health.diverged``; ``run@healthy`` skips it), and
        ``on_divergence`` says what the take does: ``"warn"`` (default), ``"raise"``
        (ReplicaDivergenceError on the committing rank, DistributedError on every rank,
        nothing committed) or ``"ignore"``. A DDP module's buffers (a batch norm's running
        statistics, each rank's own between the broadcasts of its forward passes) are not
        compared.

        ``delta_base`` (default ``ckstore.STORE_DEFAULT``: the store's ``delta_base``, None
        unless set) stores each new chunk as the XOR of its bits with the chunk at the same
        place of the same key in that snapshot, when that is smaller: ``"parent"`` is the
        run's latest snapshot (a run's first take stores everything whole), or any snapshot
        ref (a base model for fine-tunes).
        Chains are kept within ``delta_depth`` links; reads and restores are unchanged.
        Single-process takes only. While compaction runs after takes (``auto_compact``, loose
        ``take_codec``), ``"parent"`` is left to it: it stores older snapshots as deltas
        against their parents anyway, off the take's critical path.

        ``no_dist=True`` takes in this process alone even under torch.distributed (no
        collectives), for code that runs on one rank by design, such as a trainer's checkpoint
        hook called on rank 0 only.

        ``forked_from`` (a ref) records the snapshot this state came from when it is not the
        run's previous one (a fine-tune's base): ``snap.forked_from``, the lineage's fork. Left
        out, a take records the snapshot a :meth:`StoredSnapshot.restore` of this process
        loaded last from this store, unless that is the run's latest (a resume); either way
        that restore is used up.

        A ``run@step`` this process did not save already exists: the take warns
        (``ResaveWarning``, at your line) and commits a second snapshot at that step, which
        ``run@step`` then names.

        ``tags`` are created; one that exists already is moved only with ``move_tags=True``
        (the rule of :meth:`tag` and ``force``), and none may take the name of a run, nor
        ``run`` the name of a tag (a ref names a tag first, so either would hide the other).

        The guard (docs/USAGE.md, "The guard"): while hashing, the take counts NaN and Inf
        and measures the L2 norm of every floating-point tensor (``health=False`` skips it);
        tensors that should train (parameters with ``requires_grad`` the app_state's
        optimizers update, optimizer moments, keys matching a ``trainable`` glob) whose
        chunks equal those of the run's previous snapshot although ``step`` advanced are
        stale. ``on_nonfinite`` / ``on_stale``: ``"warn"`` (default: commit, one warning per
        key pattern), ``"raise"`` (NonFiniteError / StaleStateError, nothing committed) or
        ``"ignore"``. Findings are recorded in the snapshot either way (``snap.health``,
        ``ckstore show``, ``log --healthy``, the ref ``run@healthy``).

        ``progress``: ``fn(what, done, total)`` called as the take advances (``what`` is
        ``"take"``; bytes of the state found in the store or written), from the take's threads,
        at most ten times a second and once at the end (:mod:`ckstore.engine.progress`).

        Raises:
            InvalidInputError / UnsupportedValueError: app_state holds something unstorable
                (the message names the key).
            ConflictError: a tag exists and ``move_tags`` is False, or a tag and a run would
                share a name; checked before anything is written.
            LeaseExpiredError: the take stalled past its lease; nothing was committed.
            NonFiniteError, StaleStateError: the guard refused the state (``"raise"``).
        """
        spec = _takes.spec_of(
            self._repo, LiveTakeOptions, options, run=run, step=step, tags=tags, metadata=metadata
        )
        spec = _takes.fork_of(self._repo, spec)
        return self._handle(*_takes.take(self._repo, app_state, spec, pg, progress))

    @_takes.shows(AsyncTakeOptions)
    def async_take(
        self,
        app_state: Mapping[str, Any],
        run: str = "default",
        step: int | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        pg: ProcessGroup | None = None,
        progress: ProgressFn | None = None,
        **options: Unpack[AsyncTakeOptions],
    ) -> PendingSnapshot:
        """Stage a copy of ``app_state`` now, then hash, write and commit in the background.

        Returns once the state at this call is safe: tensors are copied while they fit
        ``staging_budget`` bytes (default ``$CKSTORE_STAGING_BUDGET``, else half the available
        RAM); tensors past the budget are hashed and written before this returns. Training may
        then change everything; the snapshot holds the state as it was at this call.
        ``wait()`` returns the Snapshot or raises.
        Distributed: call on every rank; the ranks' background takes commit together and
        every rank's ``wait()`` returns the same Snapshot or raises DistributedError.
        ``delta_base``, ``no_dist``, ``tags``, ``move_tags``, ``progress`` and the guard's
        options as for :meth:`take` (a refusal surfaces from ``wait()``).
        """
        spec = _takes.spec_of(
            self._repo, AsyncTakeOptions, options, run=run, step=step, tags=tags, metadata=metadata
        )
        spec = _takes.fork_of(self._repo, spec)
        job = _takes.take_async(self._repo, app_state, spec, pg, progress)
        from .engine.take import inflight  # close and the process's exit wait for it

        inflight.track(self._repo, job.future, spec.run if step is None else f"{spec.run}@{step}")
        return PendingSnapshot.of(
            job.future, self._handle, job.staged_bytes, job.sync_bytes, job.blocking
        )

    def prepare_staging(
        self, app_state: Mapping[str, Any], *, staging_budget: int | None = None
    ) -> Future[int]:
        """Make the staging memory of an ``async_take`` of ``app_state`` ready ahead, behind
        training, so that the first ``async_take`` of the process copies at memory speed.

        An async take copies into memory the store handle keeps for the next one; the first
        of a process copies into new memory, whose every page the kernel must fault in and
        zero (several times a memcpy). Call this once the model and optimizer exist (after a
        resume's restore, say): a thread at the lowest CPU priority allocates that memory (as
        much as ``async_take`` would copy under ``staging_budget``, default the knob) and
        touches every page; nothing is read from the tensors. Until the next ``async_take``
        uses it, it is held (at most the staging budget), as after any async take.

        Returns:
            A future of the bytes made ready (``.result()`` waits).

        Raises:
            InvalidInputError / UnsupportedValueError: app_state holds something unstorable.
        """
        return _takes.prepare_staging(self._repo, app_state, staging_budget)

    @_takes.shows(TakeOptions)
    def import_checkpoint(
        self,
        path: str | os.PathLike[str],
        run: str = "default",
        step: int | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        format: str | None = None,  # noqa: A002 - the option users type
        verify: bool = True,
        progress: ProgressFn | None = None,
        **options: Unpack[TakeOptions],
    ) -> StoredSnapshot:
        """Take an existing checkpoint (file or folder) into ``run`` as one snapshot.

        ``format`` (default: detected) is one of:

        - ``"safetensors"``: a ``.safetensors`` file; its tensors become app ``model``.
        - ``"hf"``: a Hugging Face model or Trainer checkpoint folder: the weights
          (``model.safetensors``, the shards of ``model.safetensors.index.json``, or
          ``pytorch_model.bin``) as app ``model``, each ``*.pt``/``*.pth`` beside them as an app
          named after it, and every other file (``config.json``, tokenizer files) kept byte for
          byte so :meth:`Snapshot.export` writes them back.
        - ``"torch"``: a ``torch.save`` file, loaded with ``weights_only=True`` only. A flat
          name -> tensor dict becomes app ``model``; any other dict one app per top-level key.
        - ``"dcp"``: a ``torch.distributed.checkpoint`` directory written by any number of
          ranks; DCP's nested state dict is rebuilt and its top-level keys become apps.

        The snapshot also holds the app ``_source`` (the import record and kept files), and
        its metadata ``imported_from``. It is a normal take: chunks the store has are not
        written again (a second import of the same files adds no chunks), tensors are read
        from memory-mapped files (or, for DCP, temporary files past the memory budget), and
        nothing is visible until the commit. Runs in this process only (under
        torch.distributed, call it on one rank). ``delta_base`` as for :meth:`take`: the ref of
        a stored base model makes a fine-tune of it store its changed bits only; ``tags`` and
        ``move_tags`` as for :meth:`take`. The guard's options as for :meth:`take` (an imported
        file has no live modules: optimizer moments are recognised by their keys, parameters by
        ``trainable`` globs).

        ``verify`` (default True): a checkpoint that carries ckstore's digests (an export's
        safetensors ``__metadata__`` or its ``ckstore-digests.json``) is checked against them
        first, as ``ckstore verify`` does; a mismatch refuses the import. ``progress`` as for
        :meth:`take` (``what`` is ``"take"``).

        Raises:
            CorruptionError: with ``verify``, a file or tensor does not match its recorded
                digest (the message names it); nothing was imported.
            UnsafePickleError: a ``torch.save`` file (or DCP metadata) needs arbitrary
                unpickling; nothing of it ran. Load it yourself if you trust it, then ``take``.
            InvalidInputError: the path is not a readable checkpoint of the format.
            NotFoundError: nothing at ``path``.
        """
        from .interop import load_checkpoint

        spec = _takes.spec_of(
            self._repo,
            TakeOptions,
            options,
            run=run,
            step=step,
            tags=tags,
            metadata=metadata,
            no_dist=True,
        )
        if verify:
            from .interop import verify_checkpoint

            verify_checkpoint(path, refuse=True)
        with load_checkpoint(self._repo, path, format) as loaded:
            spec = spec.evolve(metadata={**loaded.metadata, **spec.metadata})
            return self._handle(*_takes.take(self._repo, loaded.apps, spec, progress=progress))

    # --- reading -------------------------------------------------------------------------
    @overload
    def get(self, ref: str) -> StoredSnapshot: ...

    @overload
    def get(self, ref: str, default: T) -> StoredSnapshot | T: ...

    def get(self, ref: str, default: Any = _REQUIRED) -> Any:
        """Resolve "run" (latest), "run@step", a tag, a snapshot name or an id prefix; also
        what ``snap.ref`` prints, ``"sft@100 (0123456789ab)"``.

        ``default`` (e.g. None) is returned when nothing matches, as ``dict.get`` does: the
        resume-if-present idiom is ``snap = store.get("sft", None)``.

        Raises:
            SnapshotNotFoundError: nothing matches and no ``default`` was given; the message
                names the closest runs and tags.
            InvalidInputError: ``ref`` is malformed (``run@``, a step that is not a number) or
                an ambiguous id prefix, whatever ``default`` is.
        """
        try:
            return self._handle(self._repo.reads.resolve(ref))
        except SnapshotNotFoundError:
            if default is _REQUIRED:
                raise
            return default

    def latest(self, run: str | None = None, *, healthy: bool = False) -> StoredSnapshot | None:
        """The newest snapshot of ``run`` (of the whole store when None), or None when there is
        none: what a training script resumes from if it is there.

        ``healthy``: the newest whose take recorded no NaN or Inf (``run@healthy``).
        """
        found = self._repo.index.list_snapshots(run=run, limit=1, healthy=healthy)
        return self._handle(found[0]) if found else None

    def log(
        self, run: str | None = None, limit: int | None = None, *, healthy: bool = False
    ) -> list[StoredSnapshot]:
        """Snapshots newest first, of one run or of all; ``healthy``: only those whose take
        recorded no NaN or Inf, no stale tensor and no replicas that disagree (from the index
        alone; snapshots without a record are left out)."""
        return [
            self._handle(r)
            for r in self._repo.index.list_snapshots(run=run, limit=limit, healthy=healthy)
        ]

    def runs(self) -> list[str]:
        """Every run name, sorted."""
        return self._repo.index.list_runs()

    # --- adapters ----------------------------------------------------------------------
    def local_take(self, spec: TakeSpec) -> LocalTake:
        """This process's part of the take ``spec`` describes, its write session open.

        For an adapter that drives a take from inside another checkpoint protocol (the DCP
        ``StorageWriter``), where :meth:`take` cannot run: the caller hashes and stores the
        chunks, builds the manifest and commits through it (docs/ARCHITECTURE.md, "A take, in
        order"), and closes it; one closed before its commit aborts and commits nothing. Its
        write session begins beside the caller's first steps; on a read-only store its first
        use of the session raises ReadOnlyStoreError.
        """
        from .engine.take.local import LocalTake

        return LocalTake(self._repo, spec).open()

    # --- history and maintenance ---------------------------------------------------------
    @contextmanager
    def holding(self) -> Iterator[str]:
        """A write session of this handle, alive (its lease renewed) until the block ends; its
        id. While it lives, a gc deletes no unindexed object (it may be this writer's), and
        :meth:`sessions` lists it: a writer names it where others look (a DCP step folder
        being saved says so, ``ckstore.dcp.folder_writer``).

        Raises:
            ReadOnlyStoreError: the store is read-only.
        """
        from .engine.lease import Lease

        with Lease(self._repo.index, self._repo.lease_seconds) as lease:
            yield lease.id

    def renew_session(self, session: str) -> None:
        """Renew write session ``session`` (:meth:`holding`'s id) for the lease length now, to
        know it is still alive at this point (a writer about to publish something that names
        its snapshot). While the index is out of reach it asks again, as long as the lease
        may still run.

        Raises:
            LeaseExpiredError: the session was ended or expired (it stopped past its lease,
                and a gc or :meth:`expire_sessions` elsewhere ended it).
            IndexDatabaseError: the index stayed out of reach for the lease's length.
        """
        seconds = self._repo.lease_seconds
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._repo.index.heartbeat(session, seconds)
                return
            except LeaseExpiredError:
                raise
            except CkstoreError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(RENEW_RETRY_SECONDS, max(0.0, deadline - time.monotonic())))

    def expire_sessions(self) -> int:
        """Mark the write sessions whose lease ran out (by this host's clock) expired in the
        index, as gc does before it trusts that no writer is alive. Each waits for its
        writer's own index transaction, so a writer stopped inside one either recorded what it
        wrote first or can record nothing now. Returns how many; 0 on a read-only store,
        where nothing is written (judge :meth:`sessions` by their ``expires_at`` there)."""
        if self._repo.read_only:
            return 0
        return self._repo.index.expire_sessions(time.time())

    def close(self) -> None:
        """Wait for this handle's async takes in flight (warning, ``RuntimeWarning``, of any
        that failed), then close the index connections and the object backend."""
        inflight = sys.modules.get("ckstore.engine.take.inflight")  # loaded by an async take
        if inflight is not None and not self._repo.closed:
            inflight.close_waits(self._repo)
        self._repo.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckstore.Store({self.url!r})"
