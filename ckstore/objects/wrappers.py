"""Cross-cutting behaviour as backend wrappers: counting (for tests and stats), fault injection.

A wrapper is itself a :class:`Backend` and forwards to ``inner``; wrappers stack.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ckstore.errors import StorageError
from ckstore.objects.backend import Backend, PutData, as_buffers


class WrappingBackend(Backend):
    """Forwards every call to ``inner``; subclasses override what they change.

    :meth:`writer` is not forwarded: a wrapper's writer keeps the pieces and publishes them
    with the wrapper's own :meth:`put`, so every object written passes through the wrapper
    (counted, or failed on purpose).
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
    """Counts calls and bytes; keeps a log of every get (name, offset, length, bytes returned).

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
