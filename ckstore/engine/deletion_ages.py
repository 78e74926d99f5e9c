"""How old the snapshots this process deleted were, per run: what a job's retention looks like
from inside it, so the compaction after takes leaves loose what retention is about to drop.

A training job that keeps its last N checkpoints (``gc(keep_last=N)``, Lightning's
``save_top_k``, the Trainer's ``save_total_limit``) deletes each snapshot N takes after it was
taken. Compaction after takes rewrites every snapshot but the newest of its run densely, so
under such a retention it compresses each snapshot once, and the next deletion throws that
work away: on the bench's training loop (270 MiB, a take every 10 steps, the last 2 kept) that
was 1.1 of the 1.5 CPU seconds a take cost behind training.

So :class:`DeletionAges` keeps, per run, the snapshots this process committed, in order
(:meth:`DeletionAges.committed`, the last :data:`WINDOW`), and the age of each it deleted (how
many it had committed in the run since: :meth:`DeletionAges.deleted`). :meth:`DeletionAges.young`
names the snapshots compaction leaves loose: of each run this process deleted from, those it
committed within one more than the oldest recent age, never more than :data:`MAX_KEEP_LOOSE`
(a retention that deletes only old snapshots must not leave a run's history uncompressed). A
snapshot is compacted once it is older than the job has been deleting them (a milestone it
keeps, a best checkpoint); a process that deletes nothing compacts as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

RECENT = 8
"""Deletions per run whose ages count: the retention of the job as it is now."""

MAX_KEEP_LOOSE = 4
"""The most of a run's newest snapshots the ages may leave loose (their raw bytes on disk)."""

WINDOW = 64
"""Commits per run remembered to tell a deleted snapshot's age."""


class DeletionAges:
    """Per run, this process's recent commits and the ages of those it deleted (thread-safe)."""

    def __init__(self) -> None:
        self._commits: dict[str, deque[str]] = {}
        self._ages: dict[str, deque[int]] = {}
        self._lock = threading.Lock()

    def committed(self, run: str, snapshot_id: str) -> None:
        """This process committed ``snapshot_id`` in ``run``."""
        with self._lock:
            self._commits.setdefault(run, deque(maxlen=WINDOW)).append(snapshot_id)

    def deleted(self, snapshot_ids: Iterable[str]) -> None:
        """This process deleted these snapshots: each one it committed gets its age recorded
        (the commits of its run since); the others are not this job's retention to learn."""
        gone = set(snapshot_ids)
        with self._lock:
            for run, commits in self._commits.items():
                order = list(commits)  # deleted ones stay: ages count every commit since
                for i, sid in enumerate(order):
                    if sid in gone:
                        self._ages.setdefault(run, deque(maxlen=RECENT)).append(len(order) - 1 - i)

    def young(self) -> set[str]:
        """The snapshots compaction after takes leaves loose for now (module docstring; some
        may be deleted already)."""
        with self._lock:
            found: set[str] = set()
            for run, ages in self._ages.items():
                if ages:
                    n = min(max(ages) + 1, MAX_KEEP_LOOSE)
                    found.update(list(self._commits.get(run, ()))[-n:])
            return found
