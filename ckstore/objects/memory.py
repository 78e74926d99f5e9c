"""Memory of this process's own, given back to the system when dropped, and huge pages for the
large buffers a read fills at once."""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from typing import Any

HUGE_MIN_BYTES = 4 << 20
"""Buffers smaller than this are left to the kernel's default (NumPy's threshold for the same
advice); nor is one smaller than a huge page."""

HUGE_FREE_SHARE = 0.5
"""At most this share of the huge pages free right now is asked for by one process, so the
faults that fill them find free blocks rather than wait for the kernel to compact memory."""

BUDDYINFO_MAX_AGE_S = 1.0
"""How long one reading of the free huge pages is trusted (less what was asked for since)."""

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_THP = "/sys/kernel/mm/transparent_hugepage/"
_BUDDYINFO = "/proc/buddyinfo"


def private_memory(n: int) -> mmap.mmap:
    """``n`` bytes of anonymous memory private to this process.

    An anonymous mapping, not the heap: its memory goes back to the system when it is dropped
    (a freed heap block of this size stays in the process). Private, not ``mmap(-1, n)``'s
    default shared mapping: a child forked while the buffer exists (a DataLoader worker, a
    launcher forking ranks) must get its own copy of the pages, or siblings reading at once
    would overwrite each other's payloads between a read and its checks.
    """
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # no fork where there is no MAP_PRIVATE (Windows)
        return mmap.mmap(-1, n)
    return mmap.mmap(-1, n, flags=private | mmap.MAP_ANONYMOUS)


def address_of(buf: Any) -> int:
    """The address of a writable buffer's first byte (an ``mmap``, a ``bytearray``)."""
    import ctypes

    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the export taken to read it is released


def huge_memory(n: int) -> tuple[mmap.mmap, int] | None:
    """A private mapping (:func:`private_memory`) holding ``n`` bytes from the returned offset,
    backed by transparent huge pages, for a buffer a read fills at once; None where they are
    not worth asking for (allocate as usual then).

    Filling fresh memory costs a page fault per page, each zeroing its page: 4 KiB pages fill
    at about a third of a copy into memory already touched, 2 MiB pages at nearly its speed
    (64 MiB here: 44 ms against 12 ms). The mapping is the buffer's own (the advice goes with
    it, never left on heap memory a later allocation reuses) and its bytes start on a huge
    page boundary, so every whole huge page of them is one (the rest, under one huge page,
    stays in small pages: a huge page there would hold up to 2 MiB nobody uses); asked for
    (``madvise(MADV_HUGEPAGE)``) only where it changes something and costs no wait:

    - Linux, ``n`` at least :data:`HUGE_MIN_BYTES` and one huge page;
    - the system's mode is ``madvise`` (with ``always`` the kernel already uses them; with
      ``never``, or no transparent huge pages, there is nothing to ask for);
    - the huge pages are free right now (``/proc/buddyinfo``, free blocks of a huge page and
      larger): where they are not, a fault in an advised range may wait while the kernel
      compacts memory (``defrag=madvise``), so nothing is asked. One process asks for at most
      :data:`HUGE_FREE_SHARE` of them between two readings. Other processes allocating at the
      same moment, or a shortage on this CPU's NUMA node (the reading sums every node), can
      still leave a fault to compaction, as for any NumPy array of this size.

    In a virtual machine whose balloon reports free huge-page blocks to its host (free page
    reporting), such a block faults in from the host again when it is used: filling it is
    slower and varies more than above, most for large buffers allocated at once.
    """
    if sys.platform != "linux" or n < HUGE_MIN_BYTES:
        return None
    huge = _FREE.huge_page()
    if huge is None or n < huge or not _FREE.take(n // huge * huge):
        return None
    try:
        mem = private_memory(n + huge)
    except OSError:  # out of address space or mappings (vm.max_map_count): as usual then
        return None
    base = address_of(mem)
    start = -(-base // huge) * huge - base
    # from the mapping's start (untouched before ``start``): two mappings per buffer, not three
    _madvise(base, start + n // huge * huge, _MADV_HUGEPAGE)
    return mem, start


def thp_mode(text: str) -> str | None:
    """The selected mode of ``/sys/kernel/mm/transparent_hugepage/enabled`` (``"always
    [madvise] never"`` -> ``"madvise"``); None if none is marked."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def free_huge_bytes(buddyinfo: str, page: int = 4096, huge: int = 2 << 20) -> int:
    """Bytes free in blocks of at least one huge page (``huge`` bytes, of base pages of
    ``page`` bytes), from ``/proc/buddyinfo``'s text: per zone, the free blocks of order 0,
    1, ... (a block of order ``o`` is ``page << o`` bytes). The DMA zone does not count."""
    order = (huge // page).bit_length() - 1
    total = 0
    for line in buddyinfo.splitlines():
        fields = line.split()
        if "zone" not in fields:
            continue
        at = fields.index("zone")
        if fields[at + 1 : at + 2] == ["DMA"]:  # the first 16 MiB: not for user memory
            continue
        for o, count in enumerate(fields[at + 2 :]):
            if o >= order and count.isdigit():
                total += int(count) * (page << o)
    return total


class _FreeHugePages:
    """The huge page size where asking for them makes sense here, and what this process may
    still ask for: a share of the free huge pages, read again once
    :data:`BUDDYINFO_MAX_AGE_S` old."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._huge: int | None | bool = False  # False: not read yet
        self._left = 0
        self._read_at = -1e9

    def huge_page(self) -> int | None:
        """The huge page size in bytes if the mode is ``madvise``, else None."""
        with self._lock:
            if self._huge is False:
                mode = _read_text(_THP + "enabled", thp_mode)
                size = _read_text(_THP + "hpage_pmd_size", lambda t: int(t.strip()))
                self._huge = size if mode == "madvise" and size and size > mmap.PAGESIZE else None
            return self._huge if isinstance(self._huge, int) else None

    def take(self, n: int) -> bool:
        huge = self.huge_page()
        with self._lock:
            if huge is None:
                return False
            now = time.monotonic()
            if now - self._read_at > BUDDYINFO_MAX_AGE_S:
                free = _read_text(_BUDDYINFO, lambda t: free_huge_bytes(t, mmap.PAGESIZE, huge))
                self._left, self._read_at = int((free or 0) * HUGE_FREE_SHARE), now
            if n > self._left:
                return False
            self._left -= n
            return True


def _read_text(path: str, parse: Any) -> Any:
    try:
        with open(path, encoding="ascii") as f:
            return parse(f.read())
    except (OSError, ValueError, IndexError):
        return None


_FREE = _FreeHugePages()
_LIBC: list[Any] = []


def _forget_in_child() -> None:
    """A forked child starts with its own budget (and lock: the parent's may be held)."""
    global _FREE
    _FREE = _FreeHugePages()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    import ctypes

    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC.append(libc)
    return bool(_LIBC[0].madvise(address, nbytes, advice) == 0)
