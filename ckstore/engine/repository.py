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
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .. import objects
from ..format.manifest import Manifest
from ..index import ChunkRecord, SnapshotRecord
from ..index.forks import sqlite_work
from ..index.lite import UNSURE, LiteReads
from . import manifests
from .config import StoreConfig
from .deletion_ages import DeletionAges
from .knobs import Knobs
from .write_backs import WriteBacks

if TYPE_CHECKING:
    from ..index import Index

log = logging.getLogger("ckstore")

T = TypeVar("T")


class Spare(Generic[T]):
    """One object kept for reuse between operations of this process (an async take's staging
    arena), handed to one user at a time; thread-safe."""

    def __init__(self) -> None:
        self._item: T | None = None
        self._lock = threading.Lock()

    def take(self) -> T | None:
        """The kept object (now no longer kept), or None."""
        with self._lock:
            item, self._item = self._item, None
        return item

    def held(self) -> bool:
        """Whether an object is kept now."""
        with self._lock:
            return self._item is not None

    def offer(self, item: T, better: Callable[[T], bool]) -> None:
        """Keep ``item`` if nothing is kept, or if ``better(kept)`` says it beats the kept one."""
        with self._lock:
            if self._item is None or better(self._item):
                self._item = item

    def clear(self) -> None:
        with self._lock:
            self._item = None


class HotReads:
    """The index reads of a resume (a ref resolved, chunks located, the packs of remotes),
    answered by ``lite`` (SQLite through the standard library) where it is sure, else by the
    full index; the same answers either way (``index/lite.py``)."""

    def __init__(self, lite: LiteReads | None, full: Callable[[], Index]) -> None:
        self._lite = lite
        self._full = full

    def resolve(self, ref: str) -> SnapshotRecord:
        """``Index.resolve``: the snapshot ``ref`` names, or its errors."""
        if self._lite is not None:
            found = self._lite.resolve(ref)
            if found is not UNSURE:
                return found  # type: ignore[return-value]
        return self._full().resolve(ref)

    def chunk_locations(self, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """``Index.chunk_locations``: the known chunks among ``chunk_ids`` and their bases."""
        if self._lite is not None:
            ids = list(chunk_ids)
            found = self._lite.chunk_locations(ids)
            if found is not UNSURE:
                return found  # type: ignore[return-value]
            return self._full().chunk_locations(ids)
        return self._full().chunk_locations(chunk_ids)

    def remote_pack_ids(self) -> dict[str, str]:
        """``Index.remote_pack_ids``: pack id -> remote, for every pack of a remote."""
        if self._lite is not None:
            found = self._lite.remote_pack_ids()
            if found is not UNSURE:
                return found  # type: ignore[return-value]
        return self._full().remote_pack_ids()

    def close(self) -> None:
        if self._lite is not None:
            self._lite.close()


class Repository(Knobs):
    """One store's objects, index and config, plus the knobs of this process (the rows of
    :class:`~ckstore.engine.knobs.Knobs`: ``threads``, ``memory_budget``, ``delta_base``, ...,
    read from the environment when it opens), which may be changed on an open repository and
    affect this process only.
    """

    def __init__(
        self,
        url: str,
        objs: objects.ObjectStore,
        index: Index | Callable[[], Index],
        config: StoreConfig,
        *,
        lite: LiteReads | None = None,
    ) -> None:
        """``index``: the open index, or how to open it on first use (with ``lite``, the reads
        that answer a resume before it opens; such a repository is writable)."""
        self.url = url
        self.objects = objs
        self._index: Index | None = None if callable(index) else index
        self._open_index: Callable[[], Index] | None = index if callable(index) else None
        self._index_lock = threading.Lock()
        me = weakref.ref(self)  # no cycle: a dropped handle goes at once
        self.reads = HotReads(lite, lambda: _alive(me).index)
        """What a resume asks the index, without opening it where a SQLite file answers."""
        self.config = config
        super().__init__()
        self.spare_staging: Spare[Any] = Spare()
        """The last async take's staging arena, free for the next (``take/staging.py``)."""
        self.staging_prepared: Future[int] | None = None
        """The latest ``prepare_staging`` of this handle: an async take that finds it still
        running waits for its arena rather than make a second one."""
        self.persist_rate: float | None = None
        """Bytes per second the last take of this process stored at in the foreground (hash,
        encode, write), or None: what an async take's part past its budget blocks for."""
        # how it was opened (index URL as given, storage options), so another process can reopen it
        self.opened_with: dict[str, Any] = {"index": None, "storage_options": None}
        self._busy = 0
        self._busy_lock = threading.Lock()
        self._busy_pid = os.getpid()
        self.after_commit: list[Callable[[SnapshotRecord], None]] = []
        """Called (in order) with each snapshot a take of this process committed here; a
        failure is logged, never raised (the snapshot is committed)."""
        self.deletion_ages = DeletionAges()
        """How old the snapshots this process deleted were, per run (``deletion_ages.py``)."""
        self.before_close: list[Callable[[], None]] = []
        """Called (in order) when the repository closes, before its index and backend."""
        self.closed = False
        """True once :meth:`close` ran."""
        self.write_backs = WriteBacks(url)
        """What reads of this process healed and left to write back behind them
        (``write_backs.py``): awaited by whatever relies on the local copies, and at close."""
        self._manifest: tuple[str, Manifest] | None = None
        """The manifest the reads of a snapshot parsed last, by its id (:meth:`manifest_of`)."""

    @property
    def index(self) -> Index:
        """The store's index (SQLAlchemy), opened on first use where the open deferred it."""
        index = self._index
        if index is None:
            with self._index_lock:
                if self._index is None:
                    assert self._open_index is not None
                    self._index = self._open_index()
                index = self._index
        return index

    @property
    def index_opened(self) -> bool:
        """Whether :attr:`index` is open (a resume's open may leave it for later)."""
        return self._index is not None

    def open_index_behind(self) -> None:
        """Open :attr:`index` on a thread of its own, at this process's normal priority, when a
        resume's open left it for later: what comes after a restore (a take, ``log``) then
        finds it open. Never on a thread lowered behind training (``background.py``): whatever
        needs the index waits for its opening, and would wait behind every busy core. A fork
        meanwhile waits for it (``index/forks.py``: the child must not inherit a lock or a
        module import held by a thread that is not there); a close meanwhile leaves nothing
        open. A failure is left
        to the caller that needs the index, which meets it."""
        if self._index is not None or self._open_index is None or self.closed:
            return
        threading.Thread(target=self._open_quietly, name="ckstore-open-index").start()

    def _open_quietly(self) -> None:
        try:  # inside the fork gate throughout, its imports too (locks in the order of .index)
            with self._index_lock, sqlite_work():
                if self._index is None and not self.closed:
                    assert self._open_index is not None
                    self._index = self._open_index()
        except Exception:  # noqa: BLE001, S110 - the caller that needs the index meets it
            pass

    @property
    def compacts_later(self) -> bool:
        """Whether takes write loose chunks that a background compaction packs densely, with
        deltas against each snapshot's parent, after the next take (``auto_compact`` on and a
        loose ``take_codec``)."""
        return self.auto_compact and self.take_codec != "dense"

    def load_manifest(self, record: SnapshotRecord) -> Manifest:
        """The manifest of a committed snapshot, parsed and validated (one stored in parts is
        read whole: ``engine/manifests.py``), read from storage every time: what ``check``,
        ``repair`` and the remotes read (a snapshot's view shares one: :meth:`manifest_of`)."""
        raw = self.objects.get_blob("manifests", record.manifest_id)
        return manifests.load(self.objects, self.reads, raw, f"manifest of {describe(record)}")

    def manifest_of(self, manifest_id: str, load: Callable[[], Manifest]) -> Manifest:
        """The whole manifest named ``manifest_id`` for a read of its snapshot: the one this
        handle parsed last if it is that one, else ``load()``'s, kept in its place. A manifest
        never changes (its id is the hash of its bytes; the parse kept was checked against it)
        and readers build new containers and values from it on every read, so reads of one
        snapshot share it: a loop of ``get(ref).read_object(key)`` parses it once (4-5 ms a
        call for a state of 112 tensors here, more for larger ones). Checks read the stored
        bytes again (:meth:`load_manifest`); a take of this handle lets it go
        (:meth:`forget_manifest`; a read running meanwhile may keep its own again)."""
        kept = self._manifest
        if kept is not None and kept[0] == manifest_id:
            return kept[1]
        manifest = load()
        self._manifest = (manifest_id, manifest)
        return manifest

    def forget_manifest(self) -> None:
        """Let the manifest :meth:`manifest_of` keeps go (what every take of this handle does
        as it opens, on every rank: a training job's resume does not hold it for the run)."""
        self._manifest = None

    def kept_manifest(self, manifest_id: str) -> Manifest | None:
        """The manifest :meth:`manifest_of` keeps, if it is ``manifest_id``'s; else None."""
        kept = self._manifest
        return kept[1] if kept is not None and kept[0] == manifest_id else None

    @contextmanager
    def activity(self) -> Iterator[None]:
        """Mark a take or restore of this process as running (background work waits meanwhile)."""
        self._own_busy()
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1

    def busy(self) -> bool:
        """Whether a take or restore of this process is running (:meth:`activity`)."""
        self._own_busy()
        return self._busy > 0

    def _own_busy(self) -> None:
        """A forked child inherits the count of its parent's takes and restores running at the
        fork, whose threads it does not have: counted forever, its background compaction
        waited for them for ever (and ``wait_compacted`` with it). The child counts its own."""
        if self._busy_pid != os.getpid():
            self._busy_lock = threading.Lock()  # a thread of the parent may have held it
            self._busy, self._busy_pid = 0, os.getpid()

    def committed(self, record: SnapshotRecord) -> None:
        """Run the :attr:`after_commit` hooks for a snapshot a take just committed."""
        self.deletion_ages.committed(record.run, record.id)
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
        if self._index is None:
            return False  # deferred: only a writable store defers opening its index
        return self._index.read_only is not None

    def close(self) -> None:
        self.write_backs.close()  # healed chunks land before anything closes
        self.closed = True
        for hook in list(self.before_close):
            hook()
        self.before_close.clear()
        self.spare_staging.clear()
        self._manifest = None
        self.reads.close()
        with self._index_lock:  # an opening behind a restore finishes first, or never starts
            index = self._index
        if index is not None:
            index.close()
        self.objects.backend.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckstore.{type(self).__name__}({self.url!r})"


def _alive(ref: weakref.ref[Repository]) -> Repository:
    repo = ref()
    if repo is None:  # a handle's own reads outlived it: cannot happen through the handle
        raise ReferenceError("the repository of these reads was closed and dropped")
    return repo


def describe(record: SnapshotRecord) -> str:
    """A human ref: ``run@step`` (or the name) plus a short id."""
    base = record.name or (f"{record.run}@{record.step}" if record.step is not None else record.run)
    return f"{base} ({record.id[:12]})"
