"""Generic backend over any fsspec filesystem (used for ``memory://`` and unknown protocols).

Create-if-absent is enforced with a lock per (filesystem, root) inside this process plus an
existence check, so it is atomic only among writers of one process; object stores that support
conditional writes get their own backend (``s3.py``). Objects are written to a temporary name
and moved into place, except on the memory filesystem, where a file becomes visible only when
it is closed.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec

from ckstore.errors import CkstoreError, StorageError
from ckstore.objects.backend import (
    Backend,
    PutData,
    as_buffers,
    check_range,
    not_found,
    truncated,
    validate_name,
    validate_prefix,
    write_failed,
)

_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_for(protocol: str, root: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((protocol, root), threading.Lock())


def _after_fork_in_child() -> None:
    """A put of the parent may have held its root's lock at the fork, by a thread the child
    does not have: the child's backends get locks of their own."""
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    proto = fs.protocol
    return proto if isinstance(proto, str) else proto[0]


class FsspecBackend(Backend):
    """Objects stored below ``root`` on an fsspec filesystem.

    Args:
        fs: the filesystem.
        root: the root path on ``fs`` (protocol stripped), without a trailing ``/``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self._fs = fs
        self._root = root.rstrip("/")
        self._proto = _protocol(fs)
        self._lock = _lock_for(self._proto, self._root)

    @property
    def url(self) -> str:
        return f"{self._proto}://{self._root.lstrip('/')}"

    @property
    def cached_locally(self) -> bool:  # type: ignore[override]
        """Local and in-memory file systems re-read from this host; the others fetch again."""
        return self._proto in ("file", "local", "memory")

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The underlying filesystem."""
        return self._fs

    def _path(self, name: str) -> str:
        return f"{self._root}/{validate_name(name)}"

    def _fail(self, verb: str, name: str, exc: BaseException) -> StorageError:
        if verb == "write":
            return write_failed(name, self.url, exc)
        return StorageError(f"cannot {verb} object {name!r} in store {self.url}: {exc}")

    def put(self, name: str, data: PutData) -> bool:
        path = self._path(name)
        views = as_buffers(data)
        with self._lock:
            try:
                if self._is_file(path):
                    return False
                self._write(path, views)
            except CkstoreError:
                raise
            except Exception as exc:
                raise self._fail("write", name, exc) from exc
        return True

    def _write(self, path: str, views: list[memoryview]) -> None:
        parent = path.rsplit("/", 1)[0]
        self._fs.makedirs(parent, exist_ok=True)
        if self._proto == "memory":
            self._write_parts(path, views)
            return
        tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.tmp-{uuid.uuid4().hex}"
        try:
            self._write_parts(tmp, views)
            self._fs.mv(tmp, path)
        finally:
            if self._fs.exists(tmp):
                self._fs.rm_file(tmp)

    def _write_parts(self, path: str, views: list[memoryview]) -> None:
        with self._fs.open(path, "wb") as f:
            for view in views:
                f.write(view)

    def _is_file(self, path: str) -> bool:
        try:
            return bool(self._fs.isfile(path))
        except FileNotFoundError:
            return False

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(offset, length)
        path = self._path(name)
        size = self.size(name)
        end = size if length is None else offset + length
        if offset > size or end > size:
            got = max(0, size - offset)
            raise truncated(name, self.url, offset, length, got)
        if end == offset:
            return b""
        try:
            data = self._fs.cat_file(path, start=offset, end=end)
        except FileNotFoundError as exc:
            raise not_found(name, self.url) from exc
        except Exception as exc:
            raise self._fail("read", name, exc) from exc
        if len(data) != end - offset:
            raise truncated(name, self.url, offset, length, len(data))
        return bytes(data)

    def size(self, name: str) -> int:
        path = self._path(name)
        try:
            info = self._fs.info(path)
        except FileNotFoundError as exc:
            raise not_found(name, self.url) from exc
        except Exception as exc:
            raise self._fail("stat", name, exc) from exc
        if info.get("type") != "file":
            raise not_found(name, self.url)
        return int(info["size"])

    def exists(self, name: str) -> bool:
        path = self._path(name)
        try:
            return self._is_file(path)
        except Exception as exc:
            raise self._fail("stat", name, exc) from exc

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            self._fs.rm_file(path)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._fail("delete", name, exc) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self._root}/{base}" if base else self._root
        try:
            found = self._fs.find(top)
        except FileNotFoundError:
            found = []
        except Exception as exc:
            raise StorageError(f"cannot list {prefix!r} in store {self.url}: {exc}") from exc
        root = self._fs._strip_protocol(self._root).rstrip("/") + "/"
        names = []
        for path in found:
            rel = self._fs._strip_protocol(path)
            rel = rel[len(root) :] if rel.startswith(root) else rel
            if rel.startswith(prefix) and not any(p.startswith(".") for p in rel.split("/")):
                names.append(rel)
        yield from sorted(names)


def memory_backend(path: str = "") -> FsspecBackend:
    """A backend on fsspec's process-global memory filesystem.

    Args:
        path: root below ``memory://``; empty means a fresh, private root for this backend.
            Two backends opened on the same non-empty path share their objects.
    """
    fs: Any = fsspec.filesystem("memory")
    root = path.strip("/") or f"ckstore-{uuid.uuid4().hex}"
    return FsspecBackend(fs, "/" + root)
