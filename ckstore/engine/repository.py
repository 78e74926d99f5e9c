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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from .. import objects
from ..errors import (
    InvalidInputError,
)
from ..format.limits import check_int, check_number
from ..format.manifest import Manifest
from ..index import Index, SnapshotRecord
from .config import (
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

    def offer(self, item: T, better: Callable[[T], bool]) -> None:
        """Keep ``item`` if nothing is kept, or if ``better(kept)`` says it beats the kept one."""
        with self._lock:
            if self._item is None or better(self._item):
                self._item = item

    def clear(self) -> None:
        with self._lock:
            self._item = None


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
        self.spare_staging: Spare[Any] = Spare()
        """The last async take's staging arena, free for the next (``take/staging.py``)."""
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
        self.spare_staging.clear()
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
