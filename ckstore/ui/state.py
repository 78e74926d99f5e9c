"""The server's hold on one store: opened on first use, history cached for a moment.

The store is opened lazily so that a store that cannot be opened (a damaged index, a schema
from another version) gives the page an error to show, and a later request tries again
(after ``ckstore migrate`` or ``reindex``). The snapshot list is cached for ``ttl`` seconds:
the page asks for several views at once, and a store of 10,000 snapshots costs a query of
about a tenth of a second to list. Actions drop the cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..store import Store
from .health import HealthCache
from .timeline import ForkCache, History, load_history


class UiState:
    """One store for the app: its views' caches and the token's guard live beside it."""

    def __init__(self, opener: Callable[[], Store], label: str, ttl: float = 2.0) -> None:
        """
        Args:
            opener: Opens the store (called again after a failure).
            label: How to name the store in error pages (its URL).
            ttl: Seconds a listed history is reused.
        """
        self._opener = opener
        self.label = label
        self._ttl = ttl
        self._lock = threading.Lock()
        self._store: Store | None = None
        self._history: tuple[float, History] | None = None
        self.forks = ForkCache()
        self.health = HealthCache()

    def store(self) -> Store:
        """The open store; opens it on first use.

        Raises:
            CkstoreError: it cannot be opened (the next call tries again).
        """
        with self._lock:
            if self._store is None:
                self._store = self._opener()
            return self._store

    def history(self) -> History:
        """Every snapshot and tag, listed at most ``ttl`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            cached = self._history
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1]
        fresh = load_history(self.store())
        with self._lock:
            self._history = (now, fresh)
        return fresh

    def changed(self) -> None:
        """Forget the cached history (after an action changed the store)."""
        with self._lock:
            self._history = None

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
