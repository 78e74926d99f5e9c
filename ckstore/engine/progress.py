"""Progress of long work (takes, restores, imports, exports, gc), told to a callback.

A callback is any ``fn(what, done, total)``: ``what`` names the work (``"take"``, ``"verify"``
and ``"restore"`` for the two passes of an atomic restore, ``"gc"``...), ``done`` and ``total``
count bytes (raw tensor bytes for takes and restores). It is called from whichever thread
finished a piece of the work, at most every ``every`` seconds and once more when the work is
done (``done == total``); an exception it raises aborts the work (a way to cancel). The
command line passes one that draws a progress bar on a terminal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

ProgressFn = Callable[[str, int, int], None]
"""``fn(what, done_bytes, total_bytes)``."""


class Meter:
    """The bytes done of one piece of work, told to ``fn`` (thread-safe, throttled)."""

    def __init__(self, fn: ProgressFn, what: str, total: int, every: float = 0.1) -> None:
        self._fn, self._what, self.total, self._every = fn, what, max(0, int(total)), every
        self.done = 0
        self._told = 0.0
        self._lock = threading.Lock()
        fn(what, 0, self.total)

    def add(self, n: int) -> None:
        """``n`` more bytes are done."""
        with self._lock:
            self.done = min(self.total, self.done + int(n))
            now = time.monotonic()
            if self.done < self.total and now - self._told < self._every:
                return
            self._told = now
            done = self.done
        self._fn(self._what, done, self.total)

    def finish(self) -> None:
        """The work is done: tell ``done == total`` (once more, if not told yet)."""
        with self._lock:
            if self.done >= self.total and self._told:
                return
            self.done = self.total
            self._told = time.monotonic()
        self._fn(self._what, self.total, self.total)


def meter(fn: ProgressFn | None, what: str, total: int) -> Meter | None:
    """A :class:`Meter` when there is a callback, else None (nothing is counted)."""
    return Meter(fn, what, total) if fn is not None else None
