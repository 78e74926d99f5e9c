"""Read-only mappings of a local backend's files: views of byte ranges that copy nothing.

A view is a slice of a shared, read-only ``mmap`` of the whole file. Its pages come from the
page cache when first touched (a cold file is read from the disk then), so touching them again
is no read from storage; :meth:`Mappings.drop` gives a range's pages back (they stay in the
page cache, and the next touch maps them again), which keeps a reader's resident memory to what
it is working on. Each file is mapped once while any view of it is alive (the mapping goes with
the last view), and a mapping outlives the file's deletion: gc unlinking a pack a restore still
reads frees its space when the restore lets go.

A file written in place after it was mapped (which breaks I2, docs/RELIABILITY.md) shows
through the mapping, so each mapping remembers the file's identity (inode, size, times) when it
was made, and :meth:`Mappings.current` says whether that still holds. Touching a mapping past
its file's end kills the process (SIGBUS), so a view is cut from the size the file had when it
was mapped and refused beyond it; a file truncated while mapped (ckstore never does it) is the
one case left that can still raise it.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import weakref
from typing import NamedTuple


class _Identity(NamedTuple):
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _identity(st: os.stat_result) -> _Identity:
    return _Identity(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_EMPTY = memoryview(b"")

DROP_BATCH = 16 << 20
"""Bytes :meth:`Mappings.drop` gathers, over all files, before it gives their pages back."""


class ShortFile(Exception):
    """A range past the end of its file (``size``: the file's length)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the file has {size} bytes")
        self.size = size


class Mappings:
    """The live mappings of one backend's files, by path (safe to use from many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: weakref.WeakValueDictionary[str, mmap.mmap] = weakref.WeakValueDictionary()
        self._made: weakref.WeakKeyDictionary[mmap.mmap, tuple[str, _Identity]] = (
            weakref.WeakKeyDictionary()
        )
        self._dropping: dict[str, tuple[int, int]] = {}  # path -> range not given back yet

    def view(self, path: str, offset: int, length: int) -> memoryview:
        """A read-only view of ``length`` bytes of the file at ``path`` from ``offset``.

        Raises:
            ShortFile: the file ends before the range does.
            OSError: the file cannot be opened (FileNotFoundError when it is missing) or mapped.
        """
        m, size = self._mapping(path)
        if offset + length > size:
            raise ShortFile(size)
        if m is None or length == 0:
            return _EMPTY
        return memoryview(m)[offset : offset + length]

    def _mapping(self, path: str) -> tuple[mmap.mmap | None, int]:
        """The file's live mapping if it still is the file at ``path``, else a new one, and its
        size (no mapping for an empty file, which cannot be mapped). A live mapping is found
        by a ``stat`` of the path alone (a restore asks once per chunk)."""
        with self._lock:
            m = self._by_path.get(path)
            made = self._made.get(m) if m is not None else None
        if m is not None and made is not None:
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode) and _identity(st) == made[1]:
                return m, st.st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(path)
            now = _identity(st)
            with self._lock:
                m = self._by_path.get(path)
                made = self._made.get(m) if m is not None else None
            if m is not None and made is not None and made[1] == now:
                return m, now.size
            if now.size == 0:
                return None, 0
            m = mmap.mmap(fd, now.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            self._by_path[path] = m
            self._dropping.pop(path, None)  # ranges of an earlier mapping of the path
            self._made[m] = (path, now)
        return m, now.size

    def read_into(self, view: memoryview, out: memoryview) -> bool:
        """Fill ``out`` with the bytes of ``view`` (a view these mappings made, as long as
        ``out``) by reading them from the file mapped, where the file at its path still is
        that file, unchanged (the same identity: inode, size, times): the same bytes, and no
        page of the mapping touched, where a copy out of it maps each page in again (after
        :meth:`drop`; an atomic restore's second pass over 270 MiB took 5-10 ms less here).
        False, with nothing read, where ``view`` is no view of these mappings, ``out`` has
        another length, or the file was replaced, deleted or changed since it was mapped: the
        caller copies the view (a mapping keeps the bytes of a file replaced or deleted).

        Raises:
            ShortFile: the file ends before the view does (cut short while it was read).
        """
        m = view.obj
        if not isinstance(m, mmap.mmap) or len(view) != len(out):
            return False
        with self._lock:
            made = self._made.get(m)
        if made is None:
            return False
        try:
            fd = os.open(made[0], os.O_RDONLY)
        except OSError:
            return False
        try:
            if _identity(os.fstat(fd)) != made[1]:
                return False
            import numpy as np  # here: reading an index or a raw chunk alone never loads numpy

            whole = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
            at = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0] - whole
            got = 0
            while got < len(out):
                n = os.preadv(fd, [out[got:]], at + got)
                if n <= 0:
                    raise ShortFile(at + got)
                got += n
        finally:
            os.close(fd)
        return True

    def current(self, view: memoryview) -> bool:
        """Whether the bytes of ``view`` are still those of the file it was cut from: False
        once that file (the same inode) was written since it was mapped. True for a view of
        a file since deleted or replaced (its mapping holds the old, unchanged bytes) and for
        any view that is not a mapping."""
        m = view.obj
        if not isinstance(m, mmap.mmap):
            return True
        with self._lock:
            made = self._made.get(m)
        if made is None:
            return True
        path, then = made
        try:
            now = _identity(os.stat(path))
        except OSError:
            return True  # deleted: the mapping keeps the bytes it had
        return now.ino != then.ino or now == then

    def drop(self, path: str, offset: int, length: int) -> None:
        """Give back the pages of that range of the file's live mapping (if any): a hint that
        they will not be touched for a while. Pages at the range's edges that other ranges
        share go too; touching them again maps them again from the page cache.

        Ranges are given back in batches: once the ranges not given back yet, over all files,
        span :data:`DROP_BATCH` bytes, each file's are given back at once (each ``madvise``
        stops every thread of the process to flush its view of the pages: one per chunk cost a
        restore of 270 MiB 5 ms of its 56 here). Until then a range stays mapped, so a reader's
        resident memory holds at most about that much besides what its threads work on (a
        bound per file let a restore over 5 packs keep 50 MiB mapped).
        """
        if length <= 0:
            return
        with self._lock:
            if path not in self._by_path:
                self._dropping.pop(path, None)
                return
            lo, hi = self._dropping.get(path, (offset, offset + length))
            self._dropping[path] = (min(lo, offset), max(hi, offset + length))
            if sum(hi - lo for lo, hi in self._dropping.values()) < DROP_BATCH:
                return
            due = [(self._by_path.get(p), lo, hi) for p, (lo, hi) in self._dropping.items()]
            self._dropping.clear()
        for m, lo, hi in due:
            if m is None:
                continue
            start = lo - lo % mmap.PAGESIZE
            try:
                end = min(len(m), hi)
                if end > start:
                    m.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):  # a hint: a mapping closed meanwhile, an odd platform
                pass


def prefetch(path: str, offset: int, length: int) -> None:
    """Ask the kernel to start reading that range of the file into the page cache, without
    waiting for it (``posix_fadvise(WILLNEED)``); a hint, so any failure is ignored.

    Skipped when the range's first and last bytes are in the page cache already (two reads
    that may not wait, ``RWF_NOWAIT``): the hint walks every page of the range, 40 us for a
    1 MiB chunk here, a tenth of a warm restore's time spent telling the kernel nothing."""
    if length <= 0 or not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if not in_page_cache(fd, offset) or not in_page_cache(fd, offset + length - 1):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


SYS = "/sys"
"""Where Linux shows its devices (sysfs)."""


def read_ahead_window(path: str) -> int:
    """The kernel's read-ahead window, in bytes, of the disk holding the file or directory at
    ``path``: how far the kernel reads ahead of a read or a page fault on its own.

    Found from the file system's device number: the block device's ``queue/read_ahead_kb``
    (a partition's is its disk's: ``/sys/dev/block/<major>:<minor>``, up one level where it
    has a ``partition`` file), else the ``read_ahead_kb`` of its backing device
    (``/sys/class/bdi/<major>:<minor>``: NFS, FUSE). 0 where it cannot be told (not Linux, a
    file system with neither, such as btrfs's own device numbers or tmpfs)."""
    try:
        dev = os.stat(path).st_dev
        ident = f"{os.major(dev)}:{os.minor(dev)}"
        block = os.path.realpath(f"{SYS}/dev/block/{ident}")
        if os.path.exists(os.path.join(block, "partition")):
            block = os.path.dirname(block)
        for name in (f"{block}/queue/read_ahead_kb", f"{SYS}/class/bdi/{ident}/read_ahead_kb"):
            try:
                with open(name) as f:
                    return int(f.read().strip()) * 1024
            except FileNotFoundError:
                continue
    except (OSError, ValueError):
        return 0
    return 0


_PROBE = bytearray(1)


def in_page_cache(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of the file is in the page cache (False when this
    system cannot tell). A probe that misses does not wait, but the kernel starts its
    read-ahead there as for any read (Linux): the page may be in soon after, so probe only a
    range about to be read anyway."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return False
    try:
        return os.preadv(fd, [_PROBE], offset, nowait) == 1
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: no such reads here
        return False
