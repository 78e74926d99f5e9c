"""Work the training job should not feel: threads at the lowest CPU priority, and as many of
them as the machine has idle cores.

What runs behind a training loop (an ``async_take``'s hashing, encoding and writing, and the
compaction after it) competes with the trainer for cores. Measured on a 2-core machine with a
one-thread CPU trainer (``bench/``, the training-loop phase), most of what the steps after an
``async_take`` lost was time the training thread spent runnable but waiting for a core that a
ckstore thread held (schedstat's run delay), not the GIL or memory bandwidth. So:

- :func:`lower_priority` puts the calling thread at nice 19 (Linux schedules threads one by one,
  so a thread's priority is its own): where the trainer wants a core, it gets it at once, and a
  background thread runs on what is left. Nothing else in the process changes.
- :func:`polite_pool` is a thread pool whose workers do that when they start.
- :func:`idle_cores` counts the cores the machine left idle since it was last asked (the
  ``background_threads`` knob's default): a CPU trainer busy on one of two cores leaves one; a
  GPU trainer on a 32-core host leaves most; a host shared with other jobs leaves what they
  leave.

Raising a thread's nice value needs no privilege; it cannot be lowered again, so a polite thread
is never reused for work a caller waits for (pools are made per use).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

LOWEST = 19
"""The nice value of a background thread (the lowest priority of the normal class)."""


def lower_priority() -> None:
    """Give the calling thread the lowest normal CPU priority (nice 19), where the system allows
    it per thread (Linux); elsewhere, or when refused, nothing changes."""
    if not hasattr(os, "setpriority") or not os.path.exists("/proc/thread-self"):
        return  # only Linux schedules each thread with its own nice value
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < LOWEST:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
    except OSError:
        pass


def polite_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``prefix``, each at the lowest priority."""
    return ThreadPoolExecutor(
        max_workers=max(1, workers), thread_name_prefix=prefix, initializer=lower_priority
    )


class _IdleMeter:
    """Idle core-seconds of the whole machine between two readings (``/proc/stat``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = self._read()
        self._cores: float | None = None

    @staticmethod
    def _read() -> tuple[float, float] | None:
        """(wall seconds, idle core-seconds since boot), or None where unknown."""
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = f.readline().split()
            ticks = os.sysconf("SC_CLK_TCK")
            idle = (int(fields[4]) + int(fields[5])) / ticks  # idle + iowait
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), idle

    def cores(self) -> float | None:
        """Cores idle on average since the previous call (one less than ``MIN_INTERVAL`` back
        gets the previous figure), or None where the system does not say (or not yet)."""
        now = self._read()
        with self._lock:
            last = self._last
            if now is None or last is None:
                return None
            if now[0] - last[0] < MIN_INTERVAL:
                return self._cores
            self._last = now
            self._cores = max(0.0, (now[1] - last[1]) / (now[0] - last[0]))
            return self._cores


MIN_INTERVAL = 0.2
"""Readings closer than this reuse the previous figure (too few clock ticks to count)."""

_meter = _IdleMeter()


def idle_cores() -> int:
    """Whole cores the machine left idle since this was last asked (at least 1: background work
    always progresses, at the lowest priority); the CPU count less one where unknown."""
    cores = _meter.cores()
    if cores is None:
        return max(1, (os.cpu_count() or 2) - 1)
    return max(1, min(os.cpu_count() or 1, int(cores + 0.5)))
