"""Local-disk backend: one file per object under a root directory, written atomically.

A put writes a temporary file in the object's own directory (named ``.<name>.tmp-<random>``,
never listed: object names cannot start with ``.``), fsyncs it, hard-links it into place with
``os.link`` (which fails with ``FileExistsError`` if the name exists, making create-if-absent
atomic), removes the temporary name and fsyncs the directory.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ckstore.errors import CkstoreError, CorruptionError, StorageError
from ckstore.objects.backend import (
    Backend,
    Buffer,
    ObjectWriter,
    PutData,
    as_buffers,
    check_range,
    not_found,
    truncated,
    validate_name,
    validate_prefix,
    write_failed,
)
from ckstore.objects.direct import DirectAppender, open_direct
from ckstore.objects.mapping import Mappings, ShortFile, prefetch, read_ahead_window

EACH_BYTES = 512 << 10
"""The pieces :meth:`LocalBackend.get_into_each` reads: half a core's L2 cache here (1 MiB).
Over 270 MiB, 256 KiB and 1 MiB measured alike, 128 KiB slower (more reads), a whole 4 MiB
chunk slower (checked from the L3 cache or memory); over 2 GiB, 256 KiB 3% faster, 1 MiB 2%
slower (docs/BENCHMARKS.md)."""

_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def _fsync_dir(path: str) -> None:
    """Make a directory's entries durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_PATHS_KEPT = 4096
"""Object paths a :class:`LocalBackend` remembers (then it starts again)."""


class LocalBackend(Backend):
    """Objects as plain files below ``root`` (created if missing).

    Args:
        root: directory that holds the objects.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.path.abspath(os.fspath(root))
        self._url = Path(self._root).as_uri()
        self._paths: dict[str, str] = {}  # name -> path, for names already validated
        self._maps = Mappings()
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create store directory {self._root}: {exc}") from exc

    @property
    def url(self) -> str:
        return self._url

    @property
    def root(self) -> str:
        """The absolute root directory."""
        return self._root

    def _path(self, name: str) -> str:
        path = self._paths.get(name) if isinstance(name, str) else None
        if path is None:
            path = os.path.join(self._root, *validate_name(name).split("/"))
            if len(self._paths) >= _PATHS_KEPT:  # every read of a chunk asks for its pack's
                self._paths.clear()
            self._paths[name] = path
        return path

    def _makedirs(self, directory: str) -> None:
        """Create ``directory`` and make every new entry durable in its parent."""
        missing = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            _fsync_dir(os.path.dirname(d))

    def put(self, name: str, data: PutData) -> bool:
        path = self._path(name)
        views = as_buffers(data)
        if os.path.exists(path):
            return False
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            self._makedirs(directory)
            self._write_durably(tmp, views)
            created = self._publish(tmp, path)
        except OSError as exc:
            raise write_failed(name, self.url, exc) from exc
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if created:
            _fsync_dir(directory)
        return created

    @staticmethod
    def _write_durably(tmp: str, views: list[memoryview]) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for view in views:
                _write_all(fd, view)
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _publish(tmp: str, path: str) -> bool:
        """Link ``tmp`` to ``path`` unless it exists; True if this call created it."""
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINK_ERRNOS:
                raise
        # Filesystem without hard links: rename is atomic but may replace an identical object.
        if os.path.exists(path):
            return False
        os.replace(tmp, path)
        return True

    cached_locally = True

    def writer(self, direct: bool = False) -> ObjectWriter:
        """A writer staging its bytes in a temporary file of the store's root (same file system
        as every object: published with the same link as :meth:`put`); with ``direct``, they
        go around the page cache where the file system allows (``objects/direct.py``)."""
        return _FileWriter(self, direct)

    def sweep_temporary(self, older_than: float) -> int:
        """Delete temporary files (``.<...>.tmp-<hex>``, ``.writer-<hex>.tmp``) of writes a killed
        process left, last modified before ``older_than``."""
        swept = 0
        for dirpath, dirnames, filenames in os.walk(self._root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for fn in filenames:
                if not (fn.startswith(".") and (".tmp-" in fn or fn.startswith(".writer-"))):
                    continue
                path = os.path.join(dirpath, fn)
                try:
                    if os.stat(path).st_mtime < older_than:
                        os.unlink(path)
                        swept += 1
                except FileNotFoundError:
                    continue
        return swept

    def _open(self, name: str) -> int:
        """A read-only descriptor of object ``name``'s file.

        Raises:
            ObjectNotFoundError: no file there, or something that is not a regular file (a
                folder of that name reads as missing, as the mapped view has it).
            StorageError: it cannot be opened.
        """
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise not_found(name, self.url) from exc
        except OSError as exc:
            raise StorageError(f"cannot read object {name!r} in store {self.url}: {exc}") from exc
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            regular = False
        if not regular:
            os.close(fd)
            raise not_found(name, self.url)
        return fd

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(offset, length)
        fd = self._open(name)
        try:
            return self._pread(fd, name, offset, length)
        except CkstoreError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read object {name!r} in store {self.url}: {exc}") from exc
        finally:
            os.close(fd)

    def get_into(self, name: str, offset: int, out: memoryview) -> None:
        self._read_into(name, offset, out, None)

    def get_into_each(
        self, name: str, offset: int, out: memoryview, each: Callable[[memoryview], object]
    ) -> None:
        """Read in pieces of :data:`EACH_BYTES`, each passed to ``each`` while it is still in
        the CPU's cache (a raw chunk read into place and checked: 270 MiB on 2 threads read
        and checked in 60-62 ms this way, 69-71 ms read whole then checked; reads alone 50-54)."""
        self._read_into(name, offset, out, each)

    def _read_into(
        self,
        name: str,
        offset: int,
        out: memoryview,
        each: Callable[[memoryview], object] | None,
    ) -> None:
        check_range(offset, len(out))
        fd = self._open(name)
        try:
            view = memoryview(out).cast("B")
            step = len(view) if each is None else EACH_BYTES
            start = 0
            while start < len(view):
                piece = view[start : start + step]
                got = 0
                while got < len(piece):
                    n = os.preadv(fd, [piece[got:]], offset + start + got)
                    if n == 0:
                        raise truncated(name, self.url, offset, len(view), start + got)
                    got += n
                if each is not None:
                    each(piece)
                start += len(piece)
        except CkstoreError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read object {name!r} in store {self.url}: {exc}") from exc
        finally:
            os.close(fd)

    def _pread(self, fd: int, name: str, offset: int, length: int | None) -> bytes:
        if length is None:
            size = os.fstat(fd).st_size
            if offset > size:
                raise truncated(name, self.url, offset, None, 0)
            length = size - offset
        parts = []
        got = 0
        while got < length:
            piece = os.pread(fd, min(length - got, 1 << 30), offset + got)
            if not piece:
                raise truncated(name, self.url, offset, length, got)
            parts.append(piece)
            got += len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    mapped_views = True

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """A slice of a shared read-only mapping of the file (``objects.mapping``): nothing is
        copied, and its pages come from the page cache when touched."""
        check_range(offset, length)
        path = self._path(name)
        try:
            return self._maps.view(path, offset, length)
        except ShortFile as short:
            raise truncated(name, self.url, offset, length, max(0, short.size - offset)) from None
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise not_found(name, self.url) from exc
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot map object {name!r} in store {self.url}: {exc}") from exc

    def current(self, view: memoryview) -> bool:
        return self._maps.current(view)

    def read_view_into(self, view: memoryview, out: memoryview) -> None:
        """Read from the file mapped (``Mappings.read_into``), else copy."""
        try:
            if self._maps.read_into(view, out):
                return
        except ShortFile as short:
            raise CorruptionError(
                f"a pack of store {self.url} was cut short while it was read: it has "
                f"{short.size} bytes now (stored objects must never change)"
            ) from None
        except OSError as exc:
            raise StorageError(f"cannot read a mapped object of store {self.url}: {exc}") from exc
        super().read_view_into(view, out)

    def drop(self, name: str, offset: int, length: int) -> None:
        self._maps.drop(self._path(name), offset, length)

    def prefetch(self, name: str, offset: int, length: int) -> None:
        prefetch(self._path(name), offset, length)

    def read_ahead(self) -> int:
        return read_ahead_window(self._root)

    def size(self, name: str) -> int:
        path = self._path(name)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise not_found(name, self.url) from exc
        except OSError as exc:
            raise StorageError(f"cannot stat object {name!r} in store {self.url}: {exc}") from exc
        if not os.path.isfile(path):
            raise not_found(name, self.url)
        return st.st_size

    def exists(self, name: str) -> bool:
        return os.path.isfile(self._path(name))

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise StorageError(f"cannot delete object {name!r} in store {self.url}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self._root, *base.split("/")) if base else self._root
        names = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self._root).replace(os.sep, "/")
            for fn in filenames:
                if fn.startswith("."):
                    continue
                full = fn if rel == "." else f"{rel}/{fn}"
                if full.startswith(prefix):
                    names.append(full)
        yield from sorted(names)


class _FileWriter(ObjectWriter):
    """Bytes go straight into a temporary file (``<root>/.writer-<hex>.tmp``, never listed);
    :meth:`commit` fsyncs it and publishes it as :meth:`LocalBackend.put` does. With
    ``direct``, appended bytes go around the page cache (:class:`DirectAppender`)."""

    holds_data = False

    def __init__(self, backend: LocalBackend, direct: bool = False) -> None:
        super().__init__(backend)
        self._local = backend
        self._tmp = os.path.join(backend.root, f".writer-{uuid.uuid4().hex}.tmp")
        self._appender: DirectAppender | None = None
        self._fd: int | None = None
        try:
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            if direct:
                self._appender = DirectAppender(self._fd, open_direct(self._tmp))
        except OSError as exc:
            self.abort()
            raise write_failed("a new object", backend.url, exc) from exc

    def _open(self) -> int:
        if self._fd is None:
            raise StorageError(f"object writer of {self._local.url} used after commit or abort")
        return self._fd

    def write(self, data: Buffer) -> None:
        fd = self._open()
        (view,) = as_buffers(data)
        try:
            if self._appender is not None:
                self._appender.write(view)
            else:
                _write_all(fd, view)
            self.size += len(view)
        except OSError as exc:
            self.abort()
            raise write_failed("a new object", self._local.url, exc) from exc

    def patch(self, offset: int, data: Buffer) -> None:
        fd = self._open()
        (view,) = as_buffers(data)
        if offset < 0 or offset + len(view) > self.size:
            raise StorageError(
                f"patch of {len(view)} bytes at {offset} is outside the {self.size} written"
            )
        try:
            if self._appender is not None:
                self._appender.patch(offset, view)
            while self._appender is None and len(view):
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            self.abort()
            raise write_failed("a new object", self._local.url, exc) from exc

    def commit(self, name: str) -> bool:
        fd = self._open()
        path = self._local._path(name)
        directory = os.path.dirname(path)
        try:
            if self._appender is not None:
                self._appender.finish()
                self._appender.close()
            os.fsync(fd)
            os.close(fd)
            self._fd = None
            if os.path.exists(path):
                return False
            self._local._makedirs(directory)
            created = LocalBackend._publish(self._tmp, path)
        except OSError as exc:
            raise write_failed(name, self._local.url, exc) from exc
        finally:
            self.abort()
        if created:
            _fsync_dir(directory)
        return created

    def abort(self) -> None:
        if self._appender is not None:
            self._appender.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` at ``fd``'s position (os.write may write less than asked)."""
    while len(view):
        view = view[os.write(fd, view) :]
