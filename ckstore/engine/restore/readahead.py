"""Prefetch hints for a restore's chunk jobs: the kernel told which byte ranges come next
(``Backend.prefetch``), so a cold restore reads the disk while the threads check what arrived.

What the hints leave behind: the kernel reads a hinted range into 4 KiB pages, where a plain
read or a page fault reads ahead into large folios. A warm restore of files a hinted cold
restore brought in maps and copies 4 KiB pages, and ran 1.42-1.77x as long as one of the same
files as a take left them (270 MiB, ``python bench/page_cache.py``), until they leave the page
cache. So the pass that reads through mappings (an atomic restore's check) sends none where the
kernel reads far enough ahead of a fault on its own (:func:`hinted`): there its faults read
ahead into large folios, and cold atomic restores were as fast or faster without the hints
(270 MiB, medians of 8-10 alternated runs, without against with: 236 against 324 ms at a 1 MiB
window, 252/279 at 2 MiB, 258/263 at 4 MiB, 191/240 at 8 MiB), where at the common 128 KiB
window the hints won (278 against 327 ms). Without the hints the kernel also reads the bytes
between the payloads a restore needs (an earlier snapshot's packs hold the chunks a later one
replaced): a cold restore of the benchmark's second snapshot read 1.05x its stored bytes,
1.00x hinted. A pass that reads into place (``preadv``: a ``restore(atomic=False)``) keeps the
hints: it ran 4-18% faster with them at either window."""

from __future__ import annotations

import threading
from itertools import accumulate

from ... import objects
from .jobs import Job

READ_AHEAD = 64 << 20
"""Stored bytes the first pass over a local store asks the kernel to read ahead of the chunks
being checked (``Backend.prefetch``): enough to keep the disk busy while the threads work."""

FAULTS_READ_AHEAD = 1 << 20
"""A pass that reads through mappings sends no hints where the storage reads at least this far
ahead of a fault on its own (``Backend.read_ahead``; see the module docstring)."""


def hinted(objs: objects.ObjectStore, mapped: bool) -> bool:
    """Whether a pass over ``objs`` that reads its payloads through mappings (``mapped``) or
    into place should send prefetch hints: on a store that maps its packs, unless the pass
    faults its payloads in and the kernel reads far enough ahead of a fault itself."""
    backend = objs.backend
    if not backend.mapped_views:
        return False
    return not mapped or backend.read_ahead() < FAULTS_READ_AHEAD


class ReadAhead:
    """Prefetch hints for a list of jobs in the order they run: by the time job ``i`` starts,
    the payloads of the jobs up to :data:`READ_AHEAD` stored bytes past it were hinted.

    One hint per payload, as each comes within reach: hints over longer ranges (payloads back
    to back merged, or the window topped up in large steps) made the kernel read 1-6% more
    than a cold restore needs (pages of payloads between them that it does not)."""

    def __init__(self, objs: objects.ObjectStore, jobs: list[Job]) -> None:
        self._objs, self._jobs = objs, jobs
        self._ends = [0, *accumulate(stored(j) for j in jobs)]  # stored bytes before job k
        self._next = 0  # the first job not hinted yet
        self._lock = threading.Lock()

    def upto(self, i: int) -> None:
        with self._lock:
            start, ends, n = self._next, self._ends, len(self._jobs)
            while self._next < n and (self._next <= i or ends[self._next] - ends[i] < READ_AHEAD):
                self._next += 1
            todo = self._jobs[start : self._next]
        for job in todo:
            if job.loc is not None:
                self._objs.prefetch(job.loc)


def stored(job: Job) -> int:
    """The stored bytes of a job's chunk and its delta chain (0 before it is located)."""
    return sum(link.length for link in job.loc.chain()) if job.loc is not None else 0
