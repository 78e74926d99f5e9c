"""Cross-cutting behaviour as backend wrappers: counting (for tests and stats), fault injection.

A wrapper is itself a :class:`Backend` and forwards to ``inner``; wrappers stack.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ckstore.errors import StorageError
from ckstore.objects.backend import Backend, PutData, as_buffers


class WrappingBackend(Backend):
    """Forwards every call to ``inner``; subclasses override what they change.

    :meth:`writer` is not forwarded: a wrapper's writer keeps the pieces and publishes them
    with the wrapper's own :meth:`put`, so every object written passes through the wrapper
    (counted, or failed on purpose). Nor are :meth:`view` and :attr:`mapped_views`: a
    wrapper's views are read through its own :meth:`get` (faults injected, stashed, fetched
    elsewhere) unless it forwards them itself.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return self.inner.url

    def put(self, name: str, data: PutData) -> bool:
        return self.inner.put(name, data)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.get(name, offset, length)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    @property
    def cached_locally(self) -> bool:  # type: ignore[override]
        return self.inner.cached_locally

    def sweep_temporary(self, older_than: float) -> int:
        return self.inner.sweep_temporary(older_than)

    def partial_uploads(self) -> Sequence[tuple[str, str]]:
        return self.inner.partial_uploads()

    def discard_upload(self, name: str, upload_id: str) -> None:
        self.inner.discard_upload(name, upload_id)

    def close(self) -> None:
        self.inner.close()


@dataclass
class GetRecord:
    """One get call seen by :class:`CountingBackend`."""

    name: str
    offset: int
    length: int | None
    nbytes: int


class CountingBackend(WrappingBackend):
    """Counts calls and bytes; keeps a log of every get (name, offset, length, bytes returned),
    a view counted as a get of its range. It maps where ``inner`` maps.

    Attributes:
        get_calls, bytes_read, put_calls, bytes_written, created, size_calls, list_calls,
        delete_calls: counters since construction or :meth:`reset`.
        gets: the log of get calls.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter and clear the log."""
        self.get_calls = self.bytes_read = 0
        self.put_calls = self.bytes_written = self.created = 0
        self.size_calls = self.list_calls = self.delete_calls = 0
        self.gets: list[GetRecord] = []

    def put(self, name: str, data: PutData) -> bool:
        views = as_buffers(data)
        created = self.inner.put(name, views)
        with self._lock:
            self.put_calls += 1
            self.bytes_written += sum(len(v) for v in views)
            self.created += int(created)
        return created

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.get(name, offset, length)
        with self._lock:
            self.get_calls += 1
            self.bytes_read += len(data)
            self.gets.append(GetRecord(name, offset, length, len(data)))
        return data

    @property
    def mapped_views(self) -> bool:  # type: ignore[override]
        return self.inner.mapped_views

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """Counted as a get of that range (a mapped view is read when touched)."""
        data = self.inner.view(name, offset, length)
        with self._lock:
            self.get_calls += 1
            self.bytes_read += len(data)
            self.gets.append(GetRecord(name, offset, length, len(data)))
        return data

    def current(self, view: memoryview) -> bool:
        return self.inner.current(view)

    def read_view_into(self, view: memoryview, out: memoryview) -> None:
        """Not counted: the view was counted when it was made."""
        self.inner.read_view_into(view, out)

    def drop(self, name: str, offset: int, length: int) -> None:
        self.inner.drop(name, offset, length)

    def prefetch(self, name: str, offset: int, length: int) -> None:
        self.inner.prefetch(name, offset, length)

    def read_ahead(self) -> int:
        return self.inner.read_ahead()

    def size(self, name: str) -> int:
        with self._lock:
            self.size_calls += 1
        return self.inner.size(name)

    def delete(self, name: str) -> None:
        with self._lock:
            self.delete_calls += 1
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            self.list_calls += 1
        return self.inner.list(prefix)


@dataclass(eq=False)
class FaultyBackend(WrappingBackend):
    """Injects faults for tests. Name patterns are ``fnmatch`` globs (``"packs/*"``).

    Args:
        inner: the real backend.
        flip_byte_in: gets of matching names return data with one byte flipped
            (at ``flip_at`` within the returned range, clamped).
        fail_put_at: the Nth put (1-based, counting every put) raises :class:`StorageError`
            without writing; 0 disables.
        fail_puts_matching: every put of a matching name raises :class:`StorageError`.
        truncate_reads_of: gets of matching names silently return ``truncate_by`` fewer bytes
            (a backend breaking its contract; the layers above must still catch it).
        fail_gets_matching: gets of matching names raise :class:`StorageError`.
    """

    inner: Backend
    flip_byte_in: str | None = None
    flip_at: int = 0
    fail_put_at: int = 0
    fail_puts_matching: str | None = None
    truncate_reads_of: str | None = None
    truncate_by: int = 1
    fail_gets_matching: str | None = None
    put_count: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @staticmethod
    def _match(pattern: str | None, name: str) -> bool:
        return pattern is not None and fnmatch.fnmatchcase(name, pattern)

    def put(self, name: str, data: PutData) -> bool:
        with self._lock:
            self.put_count += 1
            nth = self.put_count
        if nth == self.fail_put_at or self._match(self.fail_puts_matching, name):
            raise StorageError(f"injected fault: put #{nth} of {name!r} in store {self.url}")
        return self.inner.put(name, data)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        if self._match(self.fail_gets_matching, name):
            raise StorageError(f"injected fault: get of {name!r} in store {self.url}")
        data = self.inner.get(name, offset, length)
        if self._match(self.truncate_reads_of, name):
            data = data[: max(0, len(data) - self.truncate_by)]
        if self._match(self.flip_byte_in, name) and data:
            buf = bytearray(data)
            buf[min(self.flip_at, len(buf) - 1)] ^= 0xFF
            data = bytes(buf)
        return data


class StashingBackend(WrappingBackend):
    """Keeps a copy of every range read from ``inner`` in a spill file, so reading the same
    range again costs no storage read: an atomic restore's second pass over payloads its first
    pass checked, on a store where reading again means fetching again (S3).

    The spill file is an unnamed temporary file in ``directory`` (default: the system's
    temporary directory), gone when :meth:`close` is called or the process ends; while the
    host's memory allows, it lives in the page cache. Where it cannot be written (a full
    disk), ranges are simply read from ``inner`` again. :meth:`close` closes the spill file,
    not ``inner``, which belongs to its store.
    """

    def __init__(self, inner: Backend, directory: str | None = None) -> None:
        super().__init__(inner)
        self._spill = tempfile.TemporaryFile(dir=directory)
        self._at: dict[tuple[str, int, int], int] = {}  # (name, offset, length) -> spill offset
        self._end = 0
        self._full = False
        self._lock = threading.Lock()
        self.hits = 0
        """Ranges served from the spill file."""

    def get_into(self, name: str, offset: int, out: memoryview) -> None:
        key = (name, offset, len(out))
        with self._lock:
            at = self._at.get(key)
        if at is not None:
            _pread_exactly(self._spill.fileno(), out, at)
            with self._lock:
                self.hits += 1
            return
        self.inner.get_into(name, offset, out)
        self._keep(key, out)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is not None:
            buf = bytearray(length)
            self.get_into(name, offset, memoryview(buf))
            return bytes(buf)
        return self.inner.get(name, offset, length)

    def _keep(self, key: tuple[str, int, int], data: memoryview) -> None:
        with self._lock:
            if self._full or key in self._at:
                return
            at, self._end = self._end, self._end + len(data)
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(self._spill.fileno(), view[done:], at + done)
        except OSError:  # the spill disk is full: read again instead
            with self._lock:
                self._full = True
            return
        with self._lock:
            self._at[key] = at

    def close(self) -> None:
        """Drop the spill file (``inner`` stays open)."""
        self._spill.close()


def _pread_exactly(fd: int, out: memoryview, at: int) -> None:
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if n == 0:
            raise StorageError(f"the restore's spill file ended at {at + got}: it was truncated")
        got += n
