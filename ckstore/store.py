"""The store: an object backend plus an SQL index, and the verbs users call on it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlparse

from . import objects
from ._config import (
    CONFIG_NAME,
    DEFAULT_LEASE_SECONDS,
    StoreConfig,
    default_io_threads,
    default_memory_budget,
    default_staging_budget,
    default_threads,
)
from ._stage import stage
from ._take import TakeOptions, state_dicts, take, take_async
from .errors import ConflictError, InvalidInputError, NotFoundError, ObjectNotFoundError
from .index import Index
from .manifest import canonical_json
from .snapshot import PendingSnapshot, Snapshot


def is_local(url: str) -> bool:
    """True for plain paths and file:// URLs."""
    scheme = urlparse(url).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def local_path(url: str) -> str:
    """The absolute filesystem path of a local store URL."""
    return os.path.abspath(urlparse(url).path if url.startswith("file://") else url)


def default_index_url(url: str) -> str:
    """SQLite inside the store for local stores; an in-memory SQLite for memory:// stores."""
    if is_local(url):
        return f"sqlite:///{os.path.join(local_path(url), 'index.sqlite')}"
    if url.startswith("memory://"):
        return "sqlite:///:memory:"
    raise InvalidInputError(
        f"store {url!r} is not on a local disk: pass index=<SQLAlchemy URL> (e.g. "
        "postgresql+psycopg://user@host/db) so several hosts share one index"
    )


class Store:
    """A content-addressed checkpoint store. Build one with :func:`ckstore.open`.

    Thread-safe for concurrent takes and reads from one process; many processes and hosts may
    share a store (the index serialises commits).
    """

    def __init__(self, url: str, objs: objects.ObjectStore, index: Index, config: StoreConfig) -> None:
        self.url = url
        self.objects = objs
        self.index = index
        self.config = config
        self.threads = default_threads()
        self.io_threads = default_io_threads()
        self.memory_budget = default_memory_budget()
        self._staging_budget: int | None = None
        self.lease_seconds = float(os.environ.get("CKSTORE_LEASE_SECONDS", DEFAULT_LEASE_SECONDS))

    @property
    def staging_budget(self) -> int:
        """Bytes an ``async_take`` may copy: set explicitly, else ``default_staging_budget()``
        measured at each call (available memory changes while training runs)."""
        return default_staging_budget() if self._staging_budget is None else self._staging_budget

    @staging_budget.setter
    def staging_budget(self, value: int | None) -> None:
        self._staging_budget = value

    # --- writing -------------------------------------------------------------------------
    def take(
        self,
        app_state: Mapping[str, Any],
        run: str = "default",
        step: int | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        replicated: Sequence[str] = (),
        pg: Any = None,
        dist_timeout: float | None = None,
    ) -> Snapshot:
        """Snapshot ``app_state`` (names -> objects with ``state_dict()``) into ``run``.

        Only chunks the store lacks are written; the snapshot becomes visible atomically when
        its index transaction commits, after its packs are durable. ``tags`` move to it in the
        same transaction. Returns the committed :class:`Snapshot` with its stats.

        With ``torch.distributed`` initialised, call it on every rank with the same arguments:
        DTensors are written shard by shard, tensors of a DistributedDataParallel module or
        with keys matching a ``replicated`` glob are written once (each rank writing about
        1/world of the bytes), and any other value is kept per rank unless it is the same on
        every rank. ``dist_timeout`` (default ``CKSTORE_DIST_TIMEOUT`` or 600 s) bounds how
        long ranks wait for each other. Any rank's failure raises DistributedError on every
        rank and commits nothing.

        Raises:
            InvalidInputError / UnsupportedValueError: app_state holds something unstorable
                (the message names the key).
            LeaseExpiredError: the take stalled past its lease; nothing was committed.
        """
        from .dist import is_distributed

        if is_distributed():
            return self._dist_take(app_state, None, run, step, tags, metadata, name, replicated, pg, dist_timeout)
        return self._take_states(state_dicts(app_state), run, step, tags, metadata, name)

    def _take_options(self) -> TakeOptions:
        return TakeOptions(
            chunk_bytes=self.config.chunk_bytes,
            pack_bytes=self.config.pack_bytes,
            inline_bytes=self.config.inline_bytes,
            threads=self.threads,
            lease_seconds=self.lease_seconds,
            io_threads=self.io_threads,
        )

    def _dist_take(
        self,
        app_state: Mapping[str, Any] | None,
        states: Mapping[str, Any] | None,
        run: str,
        step: int | None,
        tags: Sequence[str],
        metadata: Mapping[str, Any] | None,
        name: str | None,
        replicated: Sequence[str],
        pg: Any,
        dist_timeout: float | None,
        comm: Any = None,
        ddp: Any = None,
    ) -> Snapshot:
        from .dist import _take as dist_take

        _check_take_args(run, step, metadata)
        record, manifest = dist_take.take(
            self, app_state, self._take_options(),
            run=run, step=step, tags=tuple(tags), metadata=dict(metadata or {}), name=name,
            replicated=tuple(replicated), pg=pg, timeout=dist_timeout, states=states, comm=comm, ddp=ddp,
        )
        return Snapshot._bind(self, record, manifest)

    def async_take(
        self,
        app_state: Mapping[str, Any],
        run: str = "default",
        step: int | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        replicated: Sequence[str] = (),
        pg: Any = None,
        dist_timeout: float | None = None,
        staging_budget: int | None = None,
    ) -> PendingSnapshot:
        """Stage a copy of ``app_state`` now, then hash, write and commit in the background.

        Returns once the state at this call is safe: tensors are copied while they fit
        ``staging_budget`` bytes (default ``$CKSTORE_STAGING_BUDGET``, else half the available
        RAM); tensors past the budget are hashed and written before this returns. Training may
        then change everything; the snapshot holds the state as it was at this call.
        ``wait()`` returns the Snapshot or raises.
        Distributed: call on every rank; the ranks' background takes commit together and
        every rank's ``wait()`` returns the same Snapshot or raises DistributedError.
        """
        from .dist import is_distributed

        if is_distributed():
            from .dist._comm import Comm
            from .dist._take import _ddp_apps, background

            comm = Comm(pg, dist_timeout)  # made here: creating a group is itself a collective
            ddp = _ddp_apps(app_state)
            staged = stage(state_dicts(app_state))
            fut: Future[Snapshot] = background().submit(
                self._dist_take, None, staged, run, step, tags, metadata, name, replicated, pg, dist_timeout, comm, ddp
            )
            return PendingSnapshot(fut)
        _check_take_args(run, step, metadata)
        budget = self.staging_budget if staging_budget is None else staging_budget
        job = take_async(
            self.objects, self.index, state_dicts(app_state), self._take_options(), budget,
            run=run, step=step, tags=tuple(tags), metadata=dict(metadata or {}), name=name,
        )
        future: Future[Snapshot] = Future()

        def bind(done: Future[Any]) -> None:
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                result = done.result()
                future.set_result(Snapshot._bind(self, result.record, result.manifest))

        job.future.add_done_callback(bind)
        return PendingSnapshot(future, staged_bytes=job.staged_bytes, sync_bytes=job.sync_bytes)

    def _take_states(
        self,
        states: Mapping[str, Any],
        run: str,
        step: int | None,
        tags: Sequence[str],
        metadata: Mapping[str, Any] | None,
        name: str | None,
    ) -> Snapshot:
        _check_take_args(run, step, metadata)
        opts = self._take_options()
        result = take(
            self.objects, self.index, states, opts,
            run=run, step=step, tags=tuple(tags), metadata=dict(metadata or {}), name=name,
        )
        return Snapshot._bind(self, result.record, result.manifest)

    # --- reading -------------------------------------------------------------------------
    def get(self, ref: str) -> Snapshot:
        """Resolve "run" (latest), "run@step", a tag, a snapshot name or an id prefix."""
        return Snapshot._bind(self, self.index.resolve(ref))

    def log(self, run: str | None = None, limit: int | None = None) -> list[Snapshot]:
        """Snapshots newest first, of one run or of all."""
        return [Snapshot._bind(self, r) for r in self.index.list_snapshots(run=run, limit=limit)]

    def runs(self) -> list[str]:
        return self.index.list_runs()

    # --- refs ----------------------------------------------------------------------------
    def tag(self, ref: str, name: str, force: bool = False) -> Snapshot:
        """Point tag ``name`` at ``ref``; moving an existing tag needs ``force=True``."""
        snap = self.get(ref)
        self.index.set_tag(name, snap.id, force=force)
        return snap

    def untag(self, name: str) -> None:
        if self.index.get_tag(name) is None:
            raise NotFoundError(f"no tag {name!r} in store {self.url}")
        self.index.delete_tag(name)

    def tags(self) -> dict[str, str]:
        """Tag name -> snapshot id."""
        return {t.name: t.snapshot_id for t in self.index.list_tags()}

    def delete(self, ref: str) -> None:
        """Forget one snapshot (its tags go with it); its bytes are reclaimed by ``gc``."""
        self.index.delete_snapshot(self.get(ref).id)

    # --- history and maintenance ---------------------------------------------------------
    def diff(self, a: str, b: str, numeric: bool = False) -> Any:
        """Compare two snapshots key by key (see :mod:`ckstore._diff`)."""
        from ._diff import diff

        return diff(self, a, b, numeric=numeric)

    def gc(self, **policy: Any) -> Any:
        """Apply a retention policy, then prune unreferenced data (see :mod:`ckstore._gc`)."""
        from ._gc import gc

        return gc(self, **policy)

    def check(self, read_data: bool | float = False, progress: Any = None) -> Any:
        """Verify the store's integrity (see :mod:`ckstore._check`)."""
        from ._check import check

        return check(self, read_data=read_data, progress=progress)

    def reindex(self) -> Any:
        """Rebuild this store's empty index from its packs and manifests (see :mod:`ckstore._reindex`)."""
        from ._reindex import reindex

        return reindex(self)

    # --- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        self.index.close()
        self.objects.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckstore.Store({self.url!r})"


def _check_take_args(run: str, step: int | None, metadata: Mapping[str, Any] | None) -> None:
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise InvalidInputError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(run, str) or not run:
        raise InvalidInputError(f"run must be a non-empty str, got {run!r}")
    try:
        canonical_json(dict(metadata or {}))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"metadata must be JSON-able (finite numbers, str, lists, dicts): {exc}") from exc


def open(  # noqa: A001 - the public verb is ckstore.open
    url: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    create: bool = True,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    inline_bytes: int | None = None,
) -> Store:
    """Open (and by default create) a store.

    Args:
        url: a local directory, ``file://``, ``memory://name``, ``s3://bucket/prefix`` or any
            fsspec URL.
        index: SQLAlchemy URL of the index. Default: SQLite inside a local store. Required for
            remote stores (PostgreSQL when many hosts share one).
        storage_options: passed to fsspec (e.g. s3fs credentials, endpoint_url).
        create: make the store if it does not exist; False raises NotFoundError instead.
        chunk_bytes, pack_bytes, inline_bytes: knobs for a NEW store (ignored when it exists).

    Raises:
        NotFoundError: no store at ``url`` and ``create`` is False.
        SchemaError: the store or index was written by another format version.
    """
    url = os.fspath(url)
    if is_local(url):
        url = local_path(url)
        if create:
            os.makedirs(url, exist_ok=True)
        elif not os.path.isdir(url):
            raise NotFoundError(f"no ckstore store at {url!r}; create it with `ckstore init {url}`")
    objs = objects.ObjectStore(objects.open_backend(url, storage_options))
    config = _load_config(objs.backend, url, create, chunk_bytes, pack_bytes, inline_bytes)
    idx = Index.open(index or default_index_url(url), create=create)
    stored = idx.set_meta("store_id", config.store_id, only_if_absent=True)
    if stored != config.store_id:
        idx.close()
        raise ConflictError(
            f"index {idx.url} belongs to another store (id {stored}) than {url} (id "
            f"{config.store_id}); point index= at this store's index"
        )
    return Store(url, objs, idx, config)


def _load_config(
    backend: objects.Backend, url: str, create: bool, chunk: int | None, pack: int | None, inline: int | None
) -> StoreConfig:
    try:
        return StoreConfig.from_json(backend.get(CONFIG_NAME), url)
    except ObjectNotFoundError:
        if not create:
            raise NotFoundError(f"no ckstore store at {url!r}; create it with `ckstore init {url}`") from None
    backend.put(CONFIG_NAME, StoreConfig.new(chunk, pack, inline).to_json())
    return StoreConfig.from_json(backend.get(CONFIG_NAME), url)  # whoever created it first wins
