"""Prefetch hints for a restore's chunk jobs: the kernel told which byte ranges come next
(``Backend.prefetch``), so a cold restore reads the disk while the threads check what arrived."""

from __future__ import annotations

import threading

from ... import objects
from .jobs import Job

READ_AHEAD = 64 << 20
"""Stored bytes the first pass over a local store asks the kernel to read ahead of the chunks
being checked (``Backend.prefetch``): enough to keep the disk busy while the threads work."""


class ReadAhead:
    """Prefetch hints for a list of jobs in the order they run: by the time job ``i`` starts,
    the payloads of the jobs up to :data:`READ_AHEAD` stored bytes past it were hinted."""

    def __init__(self, objs: objects.ObjectStore, jobs: list[Job]) -> None:
        self._objs, self._jobs = objs, jobs
        self._next = 0  # the first job not hinted yet
        self._lock = threading.Lock()

    def upto(self, i: int) -> None:
        todo: list[objects.ChunkLocation] = []
        with self._lock:
            span = sum(stored(self._jobs[k]) for k in range(i, self._next))
            while self._next < len(self._jobs) and (self._next <= i or span < READ_AHEAD):
                loc = self._jobs[self._next].loc
                if loc is not None:
                    todo.append(loc)
                span += stored(self._jobs[self._next])
                self._next += 1
        for loc in todo:
            self._objs.prefetch(loc)


def stored(job: Job) -> int:
    """The stored bytes of a job's chunk and its delta chain (0 before it is located)."""
    return sum(link.length for link in job.loc.chain()) if job.loc is not None else 0
