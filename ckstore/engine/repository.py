"""A repository: one store's object backend, SQL index and config, opened together.

This is the plumbing every layer above works on: the engine takes and restores through it,
``history`` runs gc, check, diff and reindex over it, ``distributed`` spreads takes and
restores of it over ranks, and the public :class:`ckstore.Store` holds one and puts the
user's verbs on top (``engine/view.py`` binds committed snapshots to it).

Opening a repository and reading its history never imports torch (the command line's read
commands rely on it); only reading tensors does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .. import objects
from ..errors import (
    ConflictError,
    DestinationExistsError,
    InvalidInputError,
    NotFoundError,
    ObjectNotFoundError,
    StorageError,
)
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
    check_take_codec,
    default_auto_compact,
    default_delta_depth,
    default_io_threads,
    default_lease_seconds,
    default_memory_budget,
    default_staging_budget,
    default_take_codec,
    default_threads,
)

log = logging.getLogger("ckstore")

if TYPE_CHECKING:
    from .packing import TakeOptions
    from .stage import StagingArena


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
        self._staging: StagingArena | None = None  # the last async take's, free for the next
        self._staging_lock = threading.Lock()
        self._lease_seconds = default_lease_seconds()
        self._delta_base: str | None = None
        self._delta_depth = default_delta_depth()
        self._take_codec = default_take_codec()
        # how it was opened (index URL as given, storage options), so another process can reopen it
        self.opened_with: dict[str, Any] = {"index": None, "storage_options": None}
        self._auto_compact = default_auto_compact()
        self._busy = 0
        self._busy_lock = threading.Lock()
        self.after_commit: list[Callable[[SnapshotRecord], None]] = []
        """Called (in order) with each snapshot a take of this process committed here; a
        failure is logged, never raised (the snapshot is committed)."""
        self.before_close: list[Callable[[], None]] = []
        """Called (in order) when the repository closes, before its index and backend."""

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
        self._lease_seconds = check_number(
            "lease_seconds", value, 0.0, MAX_LEASE_SECONDS, lo_open=True
        )

    @property
    def staging_budget(self) -> int:
        """Bytes an ``async_take`` may copy: set explicitly, else ``default_staging_budget()``
        measured at each call (available memory changes while training runs)."""
        return default_staging_budget() if self._staging_budget is None else self._staging_budget

    @staging_budget.setter
    def staging_budget(self, value: int | None) -> None:
        self._staging_budget = None if value is None else check_int("staging_budget", value)

    def staging_arena(self, nbytes: int, pinned: bool = False) -> StagingArena:
        """An arena of at least ``nbytes`` for an async take's copies (``pinned``: page-locked,
        for a state on a GPU): the one the last async take gave back when it fits (its pages
        are touched already: copies run at memory speed), else a new one. Give it back with
        :meth:`release_staging` once the take is done."""
        from .stage import StagingArena

        with self._staging_lock:
            arena, self._staging = self._staging, None
        if (
            arena is not None
            and arena.pinned == pinned
            and nbytes <= arena.size <= 2 * nbytes + (64 << 20)
        ):
            arena.reset()
            return arena
        return StagingArena(nbytes, pinned)

    def release_staging(self, arena: StagingArena) -> None:
        """Keep ``arena`` (no tensor cut from it is used any more) for the next async take;
        dropped when the repository closes."""
        with self._staging_lock:
            if self._staging is None or self._staging.size < arena.size:
                self._staging = arena

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

    @property
    def compacts_later(self) -> bool:
        """Whether takes write loose chunks that a background compaction packs densely, with
        deltas against each snapshot's parent, after the next take (``auto_compact`` on and a
        loose ``take_codec``)."""
        return self._auto_compact and self._take_codec != "dense"

    @property
    def take_codec(self) -> str:
        """How takes encode new whole chunks: ``"fast"`` (the default: ``exp-zstd`` for
        floats, raw otherwise; compaction rewrites them densely later), ``"raw"`` (every chunk
        as it is, also compacted later) or ``"dense"`` (``bytegroup-zstd``/``zstd`` at once)."""
        return self._take_codec

    @take_codec.setter
    def take_codec(self, value: str) -> None:
        self._take_codec = check_take_codec(value)

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
            fast=self.take_codec != "dense",
            raw=self.take_codec == "raw",
        )

    def delta_manifest(self, delta_base: str | None, run: str) -> Manifest | None:
        """The manifest a take into ``run`` stores deltas against: that of ``delta_base``
        (``"parent"``: the run's latest snapshot, none for a new run), or None.

        ``"parent"`` is deferred to compaction while it runs after takes (``auto_compact``, loose
        takes): compaction stores each loose chunk as a delta against the same place in the
        snapshot's parent anyway, against a dense keyframe, off the critical path; a take-time
        delta would cost the take time and pin its base loose (bases stay whole).

        Raises:
            SnapshotNotFoundError: ``delta_base`` is a ref that names no snapshot.
        """
        delta_base = check_delta_base(delta_base)
        if delta_base is None or self.delta_depth == 0:
            return None
        if delta_base == "parent" and self.compacts_later:
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

    @property
    def auto_compact(self) -> bool:
        """Whether takes of this process start a background compaction once older snapshots
        hold loose chunks (default True, or ``$CKSTORE_AUTO_COMPACT``)."""
        return self._auto_compact

    @auto_compact.setter
    def auto_compact(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidInputError(f"auto_compact must be True or False, got {value!r}")
        self._auto_compact = value

    @contextmanager
    def activity(self) -> Iterator[None]:
        """Mark a take or restore of this process as running (background work waits meanwhile)."""
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1

    def busy(self) -> bool:
        """Whether a take or restore of this process is running (:meth:`activity`)."""
        return self._busy > 0

    def committed(self, record: SnapshotRecord) -> None:
        """Run the :attr:`after_commit` hooks for a snapshot a take just committed."""
        for hook in list(self.after_commit):
            try:
                hook(record)
            except Exception as exc:  # noqa: BLE001 - the snapshot is committed whatever a hook does
                log.warning(
                    "ckstore: a hook after committing %s failed: %s: %s",
                    describe(record),
                    type(exc).__name__,
                    exc,
                )

    @property
    def read_only(self) -> bool:
        """True when this store refuses writes (see :func:`read_only_reason`)."""
        return self.index.read_only is not None

    def close(self) -> None:
        for hook in list(self.before_close):
            hook()
        self.before_close.clear()
        self._staging = None
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


def open_repository(
    url: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    create: bool = False,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    inline_bytes: int | None = None,
    create_index: bool | None = None,
    read_only: bool | None = None,
) -> Repository:
    """Open (with ``create``, also create) a store; see :func:`ckstore.open` for the arguments."""
    url = os.fspath(url)
    if read_only and create:
        raise InvalidInputError(f"cannot create a store read-only: {url!r} (pass create=False)")
    if is_local(url):
        url = local_path(url)
        prepare_local(url, create)
    index_url = index or default_index_url(url)
    why = read_only_reason(url, index_url, read_only)
    objs = objects.ObjectStore(objects.open_backend(url, storage_options))
    config = _load_config(objs.backend, url, create, chunk_bytes, pack_bytes, inline_bytes)
    idx = Index.open(
        index_url, create=create if create_index is None else create_index, read_only=why
    )
    if idx.read_only is None:
        stored = idx.set_meta("store_id", config.store_id, only_if_absent=True)
    else:
        stored = idx.get_meta("store_id") or config.store_id
    if stored != config.store_id:
        idx.close()
        raise ConflictError(
            f"index {idx.url} belongs to another store (id {stored}) than {url} (id "
            f"{config.store_id}); point index= at this store's index"
        )
    repo = Repository(url, objs, idx, config)
    repo.opened_with = {
        "index": index,
        "storage_options": dict(storage_options) if storage_options else None,
    }
    return repo


def read_only_reason(url: str, index_url: str, asked: bool | None) -> str | None:
    """Why a store opens read-only, or None: asked for (``read_only=True``), or (``None``, the
    default) a local store whose folder or SQLite index file is not writable (a read-only
    mount, a shared folder of someone else's); ``False`` insists on writable."""
    where = f"the store {url} is open read-only"
    if asked:
        return f"{where} (it was opened with read_only=True, or --read-only)"
    if asked is False or not is_local(url):
        return None
    path = local_path(url)
    db = os.path.join(path, "index.sqlite")
    if not os.access(path, os.W_OK) or (
        index_url == default_index_url(url) and os.path.exists(db) and not os.access(db, os.W_OK)
    ):
        return f"{where}: its folder {path} is not writable (a read-only mount or share); work on a writable copy to change it"
    return None


def how_to_create(url: str) -> str:
    """The advice that ends a "no store here" error."""
    return f"create it with `ckstore init {url}` or ckstore.open({url!r}, create=True)"


def prepare_local(path: str, create: bool) -> None:
    """Check that local ``path`` can be (or become) a store; with ``create``, make its folder.

    A store is a folder holding ``ckstore.json``. Without ``create`` anything else is refused
    (a typo must not become an empty store). With it, a missing or empty folder becomes one,
    and so does a folder holding only what ckstore itself writes into a store (another
    process creating the same store); a non-empty folder of anything else is refused by name.

    Raises:
        NotFoundError: no store at ``path`` and ``create`` is False.
        InvalidInputError: ``path``, or a folder above it, is a file.
        DestinationExistsError: ``create`` is True and ``path`` is a non-empty folder that is
            not a store.
        StorageError: the folder cannot be created (permissions, a read-only file system).
    """
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidInputError(f"{path} is a file, not a ckstore store (a store is a folder)")
    if not create:
        held = " (the folder exists but holds no ckstore.json)" if os.path.isdir(path) else ""
        raise NotFoundError(f"no ckstore store at {path!r}{held}; {how_to_create(path)}")
    if os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if not _made_by_ckstore(path, n))
        if foreign:
            shown = ", ".join(foreign[:5]) + (
                f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            )
            raise DestinationExistsError(
                f"{path} is not empty and is not a ckstore store (it holds {shown}): create the "
                "store in a new or empty folder"
            )
        return
    blocker = _file_above(path)
    if blocker is not None:
        raise InvalidInputError(
            f"cannot create a store at {path}: {blocker} is a file, not a folder"
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the store folder {path}: {exc.strerror or exc}") from exc


_STORE_NAMES = (CONFIG_NAME, "packs", "manifests")


def _made_by_ckstore(folder: str, name: str) -> bool:
    """True for what a store's own creation puts in its folder (config, index, object dirs),
    and for other stores inside it (TorchSnapshot-style steps, each a store of its own)."""
    return (
        name in _STORE_NAMES
        or name.startswith("index.sqlite")
        or name.startswith(f".{CONFIG_NAME}.tmp-")
        or os.path.isfile(os.path.join(folder, name, CONFIG_NAME))
    )


def _file_above(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` if it is a file (so no folder can go below)."""
    d = os.path.dirname(path)
    while d and not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
    return d if d and not os.path.isdir(d) else None


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
            raise NotFoundError(f"no ckstore store at {url!r}; {how_to_create(url)}") from None
    if not is_local(url):
        _refuse_foreign_prefix(backend, url)
    backend.put(CONFIG_NAME, StoreConfig.new(chunk, pack, inline).to_json())
    return StoreConfig.from_json(backend.get(CONFIG_NAME), url)  # whoever created it first wins


def _refuse_foreign_prefix(backend: objects.Backend, url: str) -> None:
    """A new remote store goes under an empty prefix (or one another creator just claimed)."""
    names = []
    for name in backend.list():
        if name == CONFIG_NAME:
            return  # created meanwhile: the create-only put below keeps the first config
        names.append(name)
        if len(names) == 3:
            break
    if names:
        raise DestinationExistsError(
            f"{url} is not empty and is not a ckstore store (it holds {', '.join(names)}{', ...' if len(names) == 3 else ''}): "
            "create the store under a new or empty prefix"
        )
