"""The local tier's reads of what it evicted: a backend that reads the remote's packs.

A chunk the local tier evicted (``local_budget``, :mod:`.evict`) keeps its index row, pointed at
the remote's own place for it: a pack of the remote (its pack row marked ``remote``). Reads go
through :class:`TierBackend`: a pack found locally is read here; a pack of the remote is read
there, with the same ranged reads, and every chunk is verified against its id as always (I3).

The remote may move a chunk meanwhile (its own compaction or gc repacked it). A read that finds
the remote's pack gone *refreshes* the rows that pointed at it (looks their chunks up in the
remote's index and points them at their new places, in one transaction) and raises
``ObjectNotFoundError``: every reader then looks the chunk up again and reads it at its new
place (docs/RELIABILITY.md, I4), as after a local compaction.

Writes, deletes and listings stay local: nothing here ever writes or deletes at the remote.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import CkstoreError, ObjectNotFoundError
from ..index import ChunkRecord, RemoteRecord
from ..objects import Backend, WrappingBackend, pack_id_from_name
from ..objects.backend import ObjectWriter, PutData
from . import config

if TYPE_CHECKING:
    from ..engine.interfaces import LocationIndex, TierIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")


class RemoteHandle:
    """The remote's repository, opened on first use and shared by the uploader and the reads;
    reopened after :meth:`reset`. Only the uploader may create it (:meth:`get` with
    ``create``), and only when the remote was never used (:func:`.config.open_or_create`);
    reads never create. ``options``: storage options for this process only (credentials given
    to ``ckstore.open``), laid over the recorded ones. ``read_only``: opened for reading alone
    (:func:`.config.open_remote`), for a handle nothing writes through."""

    def __init__(
        self,
        local: Repository,
        remote: RemoteRecord,
        options: dict[str, Any] | None = None,
        read_only: bool = False,
    ) -> None:
        self.local, self.record = local, remote
        self.options = options or {}
        self.read_only = read_only
        self._repo: Repository | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.record.name

    def get(self, create: bool = False, fresh: bool = False) -> Repository:
        """The open remote repository, its store id checked against the recorded one; with
        ``fresh``, a handle opened before is first shown to be still there
        (:func:`.config.confirm`), else reopened.

        Raises:
            NotFoundError: no store there (with ``create``: and the remote was used before).
            ConflictError: the store there is another one than recorded.
            StorageError, IndexError_: it cannot be opened or created.
        """
        if fresh and self._repo is not None:
            try:
                config.confirm(self._repo, self.name)
            except CkstoreError:
                self.reset()
        with self._lock:
            if self._repo is None:
                index: TierIndex = self.local.index
                record = index.get_remote(self.name) or self.record
                if self.options:
                    record = replace(record, options=config.merged(record.options, self.options))
                if create:
                    self._repo, _ = config.open_or_create(index, record, self.local)
                else:
                    self._repo = config.open_remote(index, record, self.read_only)
            return self._repo

    def reset(self) -> None:
        """Close the connection (after a failure): the next :meth:`get` opens it again."""
        with self._lock:
            repo, self._repo = self._repo, None
        if repo is not None:
            try:
                repo.close()
            except Exception:  # noqa: BLE001 - it failed already; closing is best effort
                pass

    def close(self) -> None:
        self.reset()


class TierBackend(WrappingBackend):
    """The local backend, reading the remote's packs for the chunks evicted there (module
    docstring). Records when each local pack was last read (:meth:`take_used`)."""

    def __init__(self, inner: Backend, local: Repository) -> None:
        super().__init__(inner)
        self._local = local
        self._index: TierIndex = local.index
        self._handles: dict[str, RemoteHandle] = {}
        self._remote_packs: dict[str, str] = self._index.remote_pack_ids()
        self._used: dict[str, float] = {}
        self._lock = threading.Lock()

    # --- reads: here, else at the remote --------------------------------------------------------
    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            data = self.inner.get(name, offset, length)
        except ObjectNotFoundError:
            return self._there(name, lambda b: b.get(name, offset, length))
        self._touch(name)
        return data

    def get_into(self, name: str, offset: int, out: memoryview) -> None:
        try:
            self.inner.get_into(name, offset, out)
        except ObjectNotFoundError:
            self._there(name, lambda b: b.get_into(name, offset, out))
            return
        self._touch(name)

    def size(self, name: str) -> int:
        try:
            return self.inner.size(name)
        except ObjectNotFoundError:
            return self._there(name, lambda b: b.size(name))

    def exists(self, name: str) -> bool:
        if self.inner.exists(name):
            return True
        pack = pack_id_from_name(name)
        remote = None if pack is None else self._remote_of(pack)
        if pack is None or remote is None:
            return False
        if remote.get().objects.backend.exists(name):
            return True
        refresh(self._local, remote.get(), remote.name, pack)  # moved there: the rows follow
        return False

    def writer(self, direct: bool = False) -> ObjectWriter:
        # the local backend's streaming writer (packs never go there)
        return self.inner.writer(direct)

    def put(self, name: str, data: PutData) -> bool:
        return self.inner.put(name, data)

    def delete(self, name: str) -> None:
        self.inner.delete(name)  # local only: the remote's packs are the remote's

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    @property
    def cached_locally(self) -> bool:  # type: ignore[override]
        """False once chunks were evicted: reading those again fetches them again."""
        return self.inner.cached_locally and not self._remote_packs

    def close(self) -> None:
        for handle in list(self._handles.values()):
            handle.close()
        self.inner.close()

    # --- the remote -----------------------------------------------------------------------------
    def use(self, handle: RemoteHandle) -> None:
        """Read the packs of remote ``handle.name`` through ``handle`` (the uploader's)."""
        with self._lock:
            self._handles[handle.name] = handle

    def handle(self, name: str) -> RemoteHandle | None:
        """The handle remote ``name``'s packs are read through, if one was made (the tier
        remote's is the uploader's, with this process's storage options)."""
        with self._lock:
            return self._handles.get(name)

    def _remote_of(self, pack_id: str) -> RemoteHandle | None:
        """The remote whose pack ``pack_id`` is, if the index says it is one."""
        name = self._remote_packs.get(pack_id)
        if name is None:
            fresh = self._index.remote_pack_ids()  # evicted since (by another process)
            with self._lock:
                self._remote_packs.update(fresh)
            name = fresh.get(pack_id)
            if name is None:
                return None
        with self._lock:
            handle = self._handles.get(name)
        if handle is None:
            record = self._index.get_remote(name)
            if record is None:
                return None
            handle = RemoteHandle(self._local, record)
            with self._lock:
                handle = self._handles.setdefault(name, handle)
        return handle

    def evicted(self, pack_ids: dict[str, str]) -> None:
        """Note packs of remotes that rows now point at (the evictor switched them)."""
        with self._lock:
            self._remote_packs.update(pack_ids)

    def _there(self, name: str, call: Any) -> Any:
        pack = pack_id_from_name(name)
        remote = None if pack is None else self._remote_of(pack)
        if pack is None or remote is None:
            raise ObjectNotFoundError(f"object {name!r} not found in store {self.url}")
        try:
            return call(remote.get().objects.backend)
        except ObjectNotFoundError:
            refresh(self._local, remote.get(), remote.name, pack)
            if not self._index.chunks_in_packs([pack]):  # compacted there: rows followed
                raise ObjectNotFoundError(
                    f"remote {remote.name!r} ({remote.record.url}) moved the chunks of pack "
                    f"{pack[:16]} into other packs; they are read from there"
                ) from None
            raise ObjectNotFoundError(self._missing(remote, pack)) from None

    def _missing(self, remote: RemoteHandle, pack: str) -> str:
        """Why a read of an evicted chunk failed, for people: which remote, where, and which
        snapshots cannot be read until it is back."""
        ids = [r.chunk_id for r in self._index.chunks_in_packs([pack])]
        users = {s for found in self._index.snapshots_using(ids).values() for s in found}
        recs = sorted(  # by run and step (ids are hashes: their order says nothing to a person)
            (self._index.get_snapshot(sid) for sid in users),
            key=lambda r: (r.run, r.step is None, r.step or 0, r.created_at),
        )
        named = [f"{r.run}@{r.step}" if r.step is not None else r.run for r in recs[:_NAMED]]
        more = f" and {len(users) - _NAMED} more" if len(users) > _NAMED else ""
        need = (
            f"snapshot(s) {', '.join(named)}{more} need it and cannot be read until it is back"
            if named
            else "no snapshot needs it any more"
        )
        return (
            f"remote {remote.name!r} at {remote.record.url} lacks pack {pack[:16]}, which this "
            f"store evicted its local copy of: {need}. Is that storage mounted and reachable? "
            f"`ckstore --store {remote.record.url} check` says what it lacks"
        )

    def _touch(self, name: str) -> None:
        pack = pack_id_from_name(name)
        if pack is not None:
            with self._lock:
                self._used[pack] = time.time()

    def take_used(self) -> dict[str, float]:
        """When each local pack was last read since the previous call (and forget them)."""
        with self._lock:
            used, self._used = self._used, {}
        return used


_NAMED = 5
"""Snapshots a missing remote pack's message names before saying how many more."""


def refresh(local: Repository, remote: Repository, name: str, pack_id: str) -> int:
    """Point the rows of chunks held in the remote's pack ``pack_id`` (gone there) at their new
    places in the remote; the number switched."""
    index: TierIndex = local.index
    theirs: LocationIndex = remote.index
    rows = index.chunks_in_packs([pack_id])
    if not rows:
        return 0
    found = theirs.chunk_locations([r.chunk_id for r in rows])
    records = ordered(found)
    switched = index.point_chunks_at_remote(
        name, records, {r.chunk_id: pack_id for r in rows if r.chunk_id in found}
    )
    if switched:
        log.info(
            "ckstore: %d chunk(s) evicted to remote %r moved there; their rows follow",
            len(switched),
            name,
        )
    return len(switched)


def ordered(found: dict[str, ChunkRecord]) -> list[ChunkRecord]:
    """The remote's rows, bases before the deltas stored against them."""
    return sorted(found.values(), key=lambda r: (r.depth, r.chunk_id))
