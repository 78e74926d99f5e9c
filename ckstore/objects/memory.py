"""Memory of this process's own, given back to the system when dropped."""

from __future__ import annotations

import mmap


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
