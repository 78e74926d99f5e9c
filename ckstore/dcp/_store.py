"""The store a DCP writer or reader works on, as something that pickles.

``dcp.async_save`` with the process executor pickles the storage writer into a background
process. An open store (database connections, threads) cannot travel, so writers and readers
keep what reopens it instead: the store URL, the index URL and the storage options. The store
is opened on first use in whichever process uses it, and never pickled.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store import Store


class StoreRef:
    """A store given open (a :class:`ckstore.Store`) or by URL; reopened lazily after pickling.

    Args:
        store: an open store, or its URL (a local path, ``s3://...``, ...).
        index: SQLAlchemy URL of the index (default: the open store's, or ckstore's default).
        storage_options: fsspec options (default: the open store's).
        create: a store given by URL is created on first use if there is none (a writer's,
            as DCP's own FileSystemWriter makes its folder); a reader's must exist.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
        create: bool = False,
    ) -> None:
        self.create = create
        self._store: Store | None = None
        if isinstance(store, (str, os.PathLike)):
            self.url = os.fspath(store)
        else:
            self.url = store.url
            self._store = store
            opened = store.opened_with
            index = index if index is not None else opened.get("index")
            storage_options = (
                storage_options if storage_options is not None else opened.get("storage_options")
            )
        self.index = index
        self.storage_options = dict(storage_options) if storage_options else None

    def get(self) -> Store:
        """The open store (opened, and with ``create`` created if missing, on first use in this
        process)."""
        if self._store is None:
            from ..store import open as open_store

            self._store = open_store(
                self.url, index=self.index, storage_options=self.storage_options, create=self.create
            )
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "index": self.index,
            "storage_options": self.storage_options,
            "create": self.create,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self.index = state["index"]
        self.storage_options = state["storage_options"]
        self.create = state.get("create", False)
        self._store = None
