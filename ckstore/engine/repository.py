"""A repository: one store's object backend, SQL index and config, opened together.

This is the plumbing every layer above works on: the engine takes and restores through it,
``history`` runs gc, check, diff and reindex over it, ``distributed`` spreads takes and
restores of it over ranks, and the public :class:`ckstore.Store` holds one and puts the
user's verbs on top. :class:`SnapshotView` binds one committed snapshot record to its
repository and (lazily) its manifest; the public snapshot handles hold one.

Opening a repository and reading its history never imports torch (the command line's read
commands rely on it); only reading tensors (:meth:`SnapshotView.reader`) does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .. import objects
from ..errors import ConflictError, InvalidInputError, NotFoundError, ObjectNotFoundError
from ..format.limits import check_int, check_number
from ..format.manifest import Manifest
from ..index import Index, SnapshotRecord
from .config import (
    CONFIG_NAME,
    MAX_LEASE_SECONDS,
    MAX_THREADS,
    StoreConfig,
    check_delta_base,
    check_depth,
    default_delta_depth,
    default_io_threads,
    default_lease_seconds,
    default_memory_budget,
    default_staging_budget,
    default_threads,
)

if TYPE_CHECKING:
    from .packing import TakeOptions
    from .restore import Reader

def is_local(url: str) -> bool:
    """True for plain paths, ``file://`` URLs and TorchSnapshot's ``fs://`` paths."""
    scheme = urlparse(url).scheme
    return scheme in ("", "file", "fs") or (len(scheme) == 1 and os.name == "nt")


def local_path(url: str) -> str:
    """The absolute filesystem path of a local store URL.

    ``fs://`` is TorchSnapshot's prefix for a file-system path: what follows it is the path
    (``fs:///abs/dir``, or ``fs://rel/dir`` relative to the working directory).
    """
    if url.startswith("fs://"):
        return os.path.abspath(url[len("fs://") :])
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


class Repository:
    """One store's objects, index and config, plus the knobs of this process.

    ``threads`` (hash/encode/decode workers), ``io_threads`` (packs written at once),
    ``memory_budget`` (restore staging in bytes; None: a share of what each restore restores,
    see ``config.restore_budget``) and ``lease_seconds`` may be changed on an open
    repository; they affect this process only.
    """

    def __init__(
        self, url: str, objs: objects.ObjectStore, index: Index, config: StoreConfig
    ) -> None:
        self.url = url
        self.objects = objs
        self.index = index
        self.config = config
        self._threads = default_threads()
        self._io_threads = default_io_threads()
        self._memory_budget: int | None = default_memory_budget()
        self._staging_budget: int | None = None
        self._lease_seconds = default_lease_seconds()
        self._delta_base: str | None = None
        self._delta_depth = default_delta_depth()
        # how it was opened (index URL as given, storage options), so another process can reopen it
        self.opened_with: dict[str, Any] = {"index": None, "storage_options": None}

    @property
    def threads(self) -> int:
        """Hash, encode and decode workers (1 to 1024)."""
        return self._threads

    @threads.setter
    def threads(self, value: int) -> None:
        self._threads = check_int("threads", value, 1, MAX_THREADS)

    @property
    def io_threads(self) -> int:
        """Packs a take writes at once (1 to 1024)."""
        return self._io_threads

    @io_threads.setter
    def io_threads(self, value: int) -> None:
        self._io_threads = check_int("io_threads", value, 1, MAX_THREADS)

    @property
    def memory_budget(self) -> int | None:
        """Bytes a restore may stage (>= 0); None: a share of what each restore restores
        (``config.restore_budget``)."""
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int | None) -> None:
        self._memory_budget = None if value is None else check_int("memory_budget", value)

    @property
    def lease_seconds(self) -> float:
        """How long a take's lease lasts between heartbeats (> 0, at most 7 days)."""
        return self._lease_seconds

    @lease_seconds.setter
    def lease_seconds(self, value: float) -> None:
        self._lease_seconds = check_number("lease_seconds", value, 0.0, MAX_LEASE_SECONDS, lo_open=True)

    @property
    def staging_budget(self) -> int:
        """Bytes an ``async_take`` may copy: set explicitly, else ``default_staging_budget()``
        measured at each call (available memory changes while training runs)."""
        return default_staging_budget() if self._staging_budget is None else self._staging_budget

    @staging_budget.setter
    def staging_budget(self, value: int | None) -> None:
        self._staging_budget = None if value is None else check_int("staging_budget", value)

    @property
    def delta_base(self) -> str | None:
        """What takes store deltas against unless they say otherwise: None (no deltas, the
        default), ``"parent"`` (the run's latest snapshot) or a snapshot ref."""
        return self._delta_base

    @delta_base.setter
    def delta_base(self, value: str | None) -> None:
        self._delta_base = check_delta_base(value)

    @property
    def delta_depth(self) -> int:
        """Longest delta chain a take builds (0 to 32; 0 stores every chunk whole). Reading a
        chunk decodes at most ``delta_depth + 1`` payloads."""
        return self._delta_depth

    @delta_depth.setter
    def delta_depth(self, value: int) -> None:
        self._delta_depth = check_depth(value)

    def take_options(self, deltas: bool = False) -> TakeOptions:
        """The options a take into this repository runs with (``deltas``: it has a base)."""
        from .packing import TakeOptions

        return TakeOptions(
            chunk_bytes=self.config.chunk_bytes,
            pack_bytes=self.config.pack_bytes,
            inline_bytes=self.config.inline_bytes,
            threads=self.threads,
            lease_seconds=self.lease_seconds,
            io_threads=self.io_threads,
            delta_depth=self.delta_depth if deltas else 0,
        )

    def delta_manifest(self, delta_base: str | None, run: str) -> Manifest | None:
        """The manifest a take into ``run`` stores deltas against: that of ``delta_base``
        (``"parent"``: the run's latest snapshot, none for a new run), or None.

        Raises:
            SnapshotNotFoundError: ``delta_base`` is a ref that names no snapshot.
        """
        delta_base = check_delta_base(delta_base)
        if delta_base is None or self.delta_depth == 0:
            return None
        if delta_base == "parent":
            latest = self.index.list_snapshots(run=run, limit=1)
            if not latest:
                return None
            record = latest[0]
        else:
            record = self.index.resolve(delta_base)
        return self.load_manifest(record)

    def load_manifest(self, record: SnapshotRecord) -> Manifest:
        """The manifest of a committed snapshot, parsed and validated."""
        raw = self.objects.get_blob("manifests", record.manifest_id)
        return Manifest.from_json(raw, where=f"manifest of {describe(record)}")

    def close(self) -> None:
        self.index.close()
        self.objects.backend.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckstore.{type(self).__name__}({self.url!r})"


def describe(record: SnapshotRecord) -> str:
    """A human ref: ``run@step`` (or the name) plus a short id."""
    base = record.name or (f"{record.run}@{record.step}" if record.step is not None else record.run)
    return f"{base} ({record.id[:12]})"


class SnapshotFields:
    """Read-only fields of a committed snapshot, from its index record (``self.record``)."""

    @property
    def record(self) -> SnapshotRecord:
        raise NotImplementedError

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def run(self) -> str:
        return self.record.run

    @property
    def step(self) -> int | None:
        return self.record.step

    @property
    def parent_id(self) -> str | None:
        return self.record.parent_id

    @property
    def created_at(self) -> float:
        return self.record.created_at

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.record.metadata)

    @property
    def name(self) -> str | None:
        return self.record.name

    @property
    def ref(self) -> str:
        """A human ref: ``run@step`` (or the name) plus a short id."""
        return describe(self.record)

    @property
    def healthy(self) -> bool | None:
        """True if its take found no NaN or Inf, False if it found some, None if it recorded
        no health (taken before ckstore did, or with ``health=False``)."""
        return self.record.healthy

    @property
    def stats(self) -> dict[str, int]:
        """Logical bytes, new bytes and chunks stored, chunks reused."""
        r = self.record
        return {
            "logical_bytes": r.logical_bytes,
            "new_bytes": r.new_bytes,
            "new_chunks": r.new_chunks,
            "reused_chunks": r.reused_chunks,
        }


class SnapshotView(SnapshotFields):
    """One committed snapshot of a repository: its record, its manifest (read on first use)."""

    def __init__(
        self, store: Repository, record: SnapshotRecord, manifest: Manifest | None = None
    ) -> None:
        self.store = store
        self._record = record
        self._manifest = manifest

    @property
    def record(self) -> SnapshotRecord:
        return self._record

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = self.store.load_manifest(self.record)
        return self._manifest

    def reader(self) -> Reader:
        """A reader of this snapshot's chunks (every chunk re-hashed on read)."""
        from .restore import Reader  # imports torch: opening a store and reading history do not

        return Reader(
            self.store.objects,
            self.store.index,
            self.manifest,
            f"snapshot {self.ref}",
            self.store.threads,
        )


def open_repository(
    url: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    create: bool = True,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    inline_bytes: int | None = None,
    create_index: bool | None = None,
) -> Repository:
    """Open (and by default create) a store; see :func:`ckstore.open` for the arguments."""
    url = os.fspath(url)
    if is_local(url):
        url = local_path(url)
        if create:
            os.makedirs(url, exist_ok=True)
        elif not os.path.isdir(url):
            raise NotFoundError(f"no ckstore store at {url!r}; create it with `ckstore init {url}`")
    objs = objects.ObjectStore(objects.open_backend(url, storage_options))
    config = _load_config(objs.backend, url, create, chunk_bytes, pack_bytes, inline_bytes)
    idx = Index.open(index or default_index_url(url), create=create if create_index is None else create_index)
    stored = idx.set_meta("store_id", config.store_id, only_if_absent=True)
    if stored != config.store_id:
        idx.close()
        raise ConflictError(
            f"index {idx.url} belongs to another store (id {stored}) than {url} (id "
            f"{config.store_id}); point index= at this store's index"
        )
    repo = Repository(url, objs, idx, config)
    repo.opened_with = {"index": index, "storage_options": dict(storage_options) if storage_options else None}
    return repo


def _load_config(
    backend: objects.Backend,
    url: str,
    create: bool,
    chunk: int | None,
    pack: int | None,
    inline: int | None,
) -> StoreConfig:
    try:
        return StoreConfig.from_json(backend.get(CONFIG_NAME), url)
    except ObjectNotFoundError:
        if not create:
            raise NotFoundError(
                f"no ckstore store at {url!r}; create it with `ckstore init {url}`"
            ) from None
    backend.put(CONFIG_NAME, StoreConfig.new(chunk, pack, inline).to_json())
    return StoreConfig.from_json(backend.get(CONFIG_NAME), url)  # whoever created it first wins
