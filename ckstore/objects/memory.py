"""Memory of this process's own, given back to the system when dropped, and huge pages for the
large buffers a pass fills at once."""

from __future__ import annotations

import mmap
import sys
import threading
import time
from typing import Any

HUGE_PAGE = 2 << 20
"""The size of a transparent huge page (x86-64 and arm64 with 4 KiB base pages)."""

HUGE_MIN_BYTES = 4 << 20
"""Buffers smaller than this are left to the kernel's default (NumPy's threshold for the same
advice)."""

HUGE_FREE_SHARE = 0.5
"""At most this share of the huge pages free right now is asked for by one process, so the
faults that fill them find free blocks and never wait for the kernel to compact memory."""

BUDDYINFO_MAX_AGE_S = 1.0
"""How long one reading of the free huge pages is trusted (less what was asked for since)."""

_MADV_HUGEPAGE = 14
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
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


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back the untouched memory at ``address`` with transparent huge pages,
    when that costs no wait; True if it was asked.

    Filling fresh memory costs a page fault per page, each zeroing its page: 4 KiB pages fill
    at about a third of a copy into memory already touched, 2 MiB pages at nearly its speed
    (64 MiB here: 44 ms against 12 ms). Asked (``madvise(MADV_HUGEPAGE)`` on the whole huge
    pages inside the range) only where it changes something and is safe:

    - Linux, ``nbytes`` at least :data:`HUGE_MIN_BYTES`;
    - the system's mode is ``madvise`` (with ``always`` the kernel already uses them; with
      ``never``, or no transparent huge pages, there is nothing to ask for);
    - the huge pages are free right now (``/proc/buddyinfo``, blocks of 2 MiB and up): where
      they are not, a fault in an advised range may wait while the kernel compacts memory
      (``defrag=madvise``), so nothing is asked. One process asks for at most
      :data:`HUGE_FREE_SHARE` of them between two readings. Other processes allocating at the
      same moment can still take them first; the fault then falls back to compaction, as it
      does for every NumPy array of this size.

    In a virtual machine whose balloon reports free 2 MiB blocks to its host (free page
    reporting), such a block faults in from the host again when it is used: filling it is
    slower and varies more than above, most for large buffers allocated at once.
    """
    if sys.platform != "linux" or nbytes < HUGE_MIN_BYTES:
        return False
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo or not _FREE.take(hi - lo):
        return False
    return _madvise(lo, hi - lo, _MADV_HUGEPAGE)


def thp_mode(text: str) -> str | None:
    """The selected mode of ``/sys/kernel/mm/transparent_hugepage/enabled`` (``"always
    [madvise] never"`` -> ``"madvise"``); None if none is marked."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def free_huge_bytes(buddyinfo: str) -> int:
    """Bytes free in blocks of at least one huge page, from ``/proc/buddyinfo``'s text (per
    zone, the free blocks of order 0, 1, ...; an order-9 block is one 2 MiB huge page)."""
    order = (HUGE_PAGE // 4096).bit_length() - 1
    total = 0
    for line in buddyinfo.splitlines():
        fields = line.split()
        if "zone" not in fields or fields[-1:] == []:
            continue
        zone = fields.index("zone")
        counts = fields[zone + 2 :]
        if fields[zone + 1] == "DMA":  # the first 16 MiB: not for user memory in practice
            continue
        for o, count in enumerate(counts):
            if o >= order and count.isdigit():
                total += int(count) * (4096 << o)
    return total


class _FreeHugePages:
    """What this process may still ask for: a share of the free huge pages, read again once
    :data:`BUDDYINFO_MAX_AGE_S` old."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mode: str | None | bool = False  # False: not read yet
        self._left = 0
        self._read_at = -1e9

    def take(self, n: int) -> bool:
        with self._lock:
            if self._mode is False:
                self._mode = _read_text(_THP_ENABLED, thp_mode)
            if self._mode != "madvise":
                return False
            now = time.monotonic()
            if now - self._read_at > BUDDYINFO_MAX_AGE_S:
                free = _read_text(_BUDDYINFO, free_huge_bytes) or 0
                self._left, self._read_at = int(free * HUGE_FREE_SHARE), now
            if n > self._left:
                return False
            self._left -= n
            return True


def _read_text(path: str, parse: Any) -> Any:
    try:
        with open(path, encoding="ascii") as f:
            return parse(f.read())
    except (OSError, ValueError):
        return None


_FREE = _FreeHugePages()
_LIBC: list[Any] = []


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    import ctypes

    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC.append(libc)
    return bool(_LIBC[0].madvise(address, nbytes, advice) == 0)
