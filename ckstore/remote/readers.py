"""The remotes a store reads chunks from, kept open for the life of its handle.

Healing (:mod:`.heal`) reads damaged chunks back from remotes. Opening a remote costs the check
of its index's schema and a read of its ``ckstore.json``; a restore that heals chunk by chunk,
a ``read_object`` after it, or a ``repair`` would pay that for every chunk. :func:`readers_of`
gives the one :class:`Readers` of a local repository instead:

- each remote is opened on first use, read-only (nothing is written there, no migration runs;
  its store id is compared with the recorded one: :func:`.config.open_remote`), and the handle
  is reused by every later read of this process through that repository;
- the tier remote of a two-tier store is read through the handle its uploader and evicted
  reads already hold (:class:`.tier.RemoteHandle`, with this process's storage options);
- a handle whose remote was pointed elsewhere since (another URL, index or options) is
  closed and opened anew; :meth:`Readers.forget` closes one after a failed read, so the next
  use opens it again;
- every handle is closed when the local repository closes.

Thread-safe: handles are opened one at a time, and a handle is shared by the threads that
read through it. Nothing read through a handle is trusted: healing hashes every chunk against
the id it asked for.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import StorageError
from .tier import RemoteHandle, TierBackend

if TYPE_CHECKING:
    from ..engine.repository import Repository
    from ..index import RemoteRecord

_READERS: weakref.WeakKeyDictionary[Repository, Readers] = weakref.WeakKeyDictionary()
_READERS_LOCK = threading.Lock()


class Readers:
    """The remotes of one local repository opened for reading (module docstring)."""

    def __init__(self, local: Repository) -> None:
        self._local = local
        self._handles: dict[str, RemoteHandle] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, record: RemoteRecord) -> Repository:
        """The store remote ``record`` names, open for reading (opened now on first use).

        Raises:
            NotFoundError, ConflictError, StorageError, IndexError_: as
                :func:`.config.open_remote`; nothing is kept then, so the next call tries again.
            StorageError: the local repository is closed.
        """
        return self._handle(record).get()

    def forget(self, name: str) -> None:
        """Close remote ``name``'s handle (a read through it failed as a whole): the next
        :meth:`get` opens it anew. The tier's handle is its uploader's, reset by its own
        failures, and left alone."""
        with self._lock:
            handle = self._handles.pop(name, None)
        if handle is not None:
            handle.reset()

    def close(self) -> None:
        """Close every handle opened here (the tier's is closed with the tier's backend)."""
        with self._lock:
            self._closed = True
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            if handle.read_only:
                handle.close()

    def _handle(self, record: RemoteRecord) -> RemoteHandle:
        tier = self._local.objects.backend
        if isinstance(tier, TierBackend):
            shared = tier.handle(record.name)
            if shared is not None and _same_place(shared.record, record):
                return shared
        with self._lock:
            if self._closed:
                raise StorageError(
                    f"store {self._local.url} is closed: open it again to read from remote "
                    f"{record.name!r}"
                )
            held = self._handles.get(record.name)
            if held is not None and _same_place(held.record, record):
                return held
            made = self._handles[record.name] = RemoteHandle(self._local, record, read_only=True)
        if held is not None:  # the remote was pointed elsewhere since it was opened
            held.close()
        return made


def readers_of(local: Repository) -> Readers:
    """The one :class:`Readers` of ``local`` in this process (made on first use, closed when
    ``local`` closes)."""
    with _READERS_LOCK:
        found = _READERS.get(local)
        if found is None:
            found = _READERS[local] = Readers(local)
            local.before_close.append(lambda: _release(local))
        return found


def _release(local: Repository) -> None:
    """Close ``local``'s readers and forget them (they hold ``local``, so the weak key alone
    would never let it go)."""
    with _READERS_LOCK:
        found = _READERS.pop(local, None)
    if found is not None:
        found.close()


def _same_place(a: RemoteRecord, b: RemoteRecord) -> bool:
    """Whether two records of a remote name the same store (name, URL, index URL and options;
    when it was added, its recorded store id and the tier mark aside)."""
    return replace(a, store_id=b.store_id, tier=b.tier, created_at=b.created_at) == b
