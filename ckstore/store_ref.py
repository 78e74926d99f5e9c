"""A store as something that pickles: given open or by URL, reopened where it is used.

``dcp.async_save`` with the process executor pickles its storage writer into a background
process; Lightning pickles its strategy (and the ``CheckpointIO`` plugin in it) into the
workers of ``strategy="ddp_spawn"``; a checkpoint file that points into a store names the store
by URL. An open store (database connections, threads) cannot travel, so these keep what reopens
it instead: the store URL, the index URL and the storage options. The store is opened on first
use in whichever process uses it, and never pickled.

A store opened in this process and handed to a :class:`StoreRef` is remembered by URL for as
long as it stays open, so a ref made from the URL alone (an unpickled plugin, a pointer file
read in the process that wrote it) uses that handle instead of opening a second one.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import Store

_OPEN: weakref.WeakValueDictionary[str, Store] = weakref.WeakValueDictionary()
"""Stores handed to a StoreRef open, by URL (a closed one is dropped when it is next asked)."""
_OPEN_LOCK = threading.Lock()


def remember(store: Store) -> None:
    """Let refs to ``store``'s URL made in this process use this open handle."""
    with _OPEN_LOCK:
        _OPEN[store.url] = store


def opened(url: str) -> Store | None:
    """The open store of ``url`` this process remembers (:func:`remember`), or None."""
    with _OPEN_LOCK:
        store = _OPEN.get(url)
    if store is None or store.closed:
        return None
    return store


class StoreRef:
    """A store given open (a :class:`ckstore.Store`) or by URL; reopened lazily after pickling.

    Args:
        store: an open store, or its URL (a local path, ``s3://...``, ...).
        index: SQLAlchemy URL of the index (default: the open store's, or ckstore's default).
        storage_options: fsspec options (default: the open store's).
        create: a store given by URL is created on first use if there is none (a writer's,
            as DCP's own FileSystemWriter makes its folder); a reader's must exist.
        read_only: a store given by URL is opened read-only (a pointer file's reader).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
        create: bool = False,
        read_only: bool | None = None,
    ) -> None:
        self.create = create
        self.read_only = read_only
        self._store: Store | None = None
        self.owned = False
        """True when this ref opened its store itself (its user closes it: :meth:`close`)."""
        if isinstance(store, (str, os.PathLike)):
            self.url = os.fspath(store)
        else:
            self.url = store.url
            self._store = store
            remember(store)
            opened_with = store.opened_with
            index = index if index is not None else opened_with.get("index")
            storage_options = (
                storage_options
                if storage_options is not None
                else opened_with.get("storage_options")
            )
        self.index = index
        self.storage_options = dict(storage_options) if storage_options else None

    @property
    def is_open(self) -> bool:
        """True when the store is open in this process (given open, or opened on first use)."""
        return self._store is not None and not self._store.closed

    def get(self) -> Store:
        """The open store (an open handle of this process for the URL, else opened, and with
        ``create`` created if missing, on first use in this process)."""
        if self._store is None or self._store.closed:
            found = opened(self.url)
            if found is not None:
                self._store = found
            else:
                from ._open import open as open_store

                self._store = open_store(
                    self.url,
                    index=self.index,
                    storage_options=self.storage_options,
                    create=self.create,
                    read_only=None if self.create else self.read_only,
                )
                self.owned = True
                remember(self._store)
        return self._store

    def close(self) -> None:
        """Close the store if this ref opened it (a store given open stays open)."""
        if self.owned and self._store is not None:
            self._store.close()
        self._store = None
        self.owned = False

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "index": self.index,
            "storage_options": self.storage_options,
            "create": self.create,
            "read_only": self.read_only,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self.index = state["index"]
        self.storage_options = state["storage_options"]
        self.create = state.get("create", False)
        self.read_only = state.get("read_only")
        self._store = None
        self.owned = False
