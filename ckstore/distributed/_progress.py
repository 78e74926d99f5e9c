"""Progress of a long distributed operation: every rank's byte counters, logged by rank 0.

Each rank counts the bytes it has moved (``Progress.add("read", n)``); the group's heartbeat
thread posts them with its beat (``prog/<rank>`` in the rendezvous store, at most once a
second, only when they changed). While the operation lasts longer than
``CKSTORE_PROGRESS_SECONDS`` (default 10), rank 0 reads every rank's counters and phase that
often and logs one line on the ``"ckstore"`` logger (INFO): bytes done (of the total when
known), the median per-rank throughput, and the slowest rank with the phase it is in. So a
long take or restore shows where it stands, and which rank holds it up, before any timeout.

Costs nothing on the ranks but a store write per second; rank 0 reads ``world`` small keys
per log line.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._group import Group

log = logging.getLogger("ckstore")
DEFAULT_SECONDS = 10.0


def interval() -> float:
    """Seconds between progress lines: ``$CKSTORE_PROGRESS_SECONDS`` (0 turns them off)."""
    try:
        return max(0.0, float(os.environ.get("CKSTORE_PROGRESS_SECONDS", DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


class Progress:
    """One rank's counters for one operation (thread-safe)."""

    def __init__(self, op: str, ident: str) -> None:
        self.op, self.ident = op, ident
        self.counts: dict[str, int] = {}
        self._watched: dict[str, Callable[[], int]] = {}
        self.total = 0  # bytes this rank expects to move in all (0: unknown)
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def add(self, what: str, nbytes: int) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + int(nbytes)

    def watch(self, what: str, count: Callable[[], int]) -> None:
        """A counter read when progress is posted (bytes another component counts)."""
        with self._lock:
            self._watched[what] = count

    def report(self) -> str:
        """This rank's counters as posted in the store."""
        with self._lock:
            counts = {**self.counts, **{k: int(f()) for k, f in self._watched.items()}}
            doc = {
                "id": self.ident,
                "t": round(time.monotonic() - self._t0, 2),
                "c": counts,
                "total": self.total,
            }
        return json.dumps(doc, separators=(",", ":"))


@contextmanager
def progress(group: Group | None, op: str) -> Iterator[Progress]:
    """Count this rank's bytes for ``op``; on rank 0, log every rank's progress meanwhile."""
    ident = (
        f"{group.generation}:{group.seq}" if group is not None else "local"
    )  # alike on every member
    p = Progress(op, ident)
    if group is None:
        yield p
        return
    group.report = p.report
    stop = threading.Event()
    every = interval()
    if group.rank == 0 and every > 0:
        threading.Thread(
            target=_log_loop, args=(group, p, stop, every), name="ckstore-progress", daemon=True
        ).start()
    try:
        yield p
    finally:
        stop.set()
        group.report = None


def _log_loop(group: Group, mine: Progress, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        try:
            line = summary(mine, group.infos("prog"), group.infos("phase"))
        except Exception:  # noqa: BLE001 - progress is best effort, never fails the operation
            return
        if line:
            log.info("%s", line)


def summary(mine: Progress, posted: list[str], phases: list[str]) -> str:
    """One line about every rank's posted counters for ``mine``'s operation ("" if none yet)."""
    ranks: list[tuple[int, float, int, int]] = []  # rank, seconds, bytes done, bytes expected
    for r, raw in enumerate(posted):
        try:
            doc: dict[str, Any] = json.loads(raw) if raw else {}
        except ValueError:
            doc = {}
        if doc.get("id") != mine.ident:
            ranks.append((r, 0.0, 0, 0))  # not started (or still on an earlier operation)
            continue
        ranks.append(
            (r, float(doc["t"]), sum(int(v) for v in doc["c"].values()), int(doc.get("total", 0)))
        )
    if not any(t for _, t, _, _ in ranks):
        return ""
    done = sum(d for _, _, d, _ in ranks)
    total = sum(x for _, _, _, x in ranks)
    rates = [(d / t if t else 0.0, r) for r, t, d, _ in ranks]
    slow_rate, slow = min(rates)
    of = f" of {_size(total)} ({100 * done / total:.0f}%)" if total else ""
    where = phases[slow] if slow < len(phases) and phases[slow] else "?"
    return (
        f"{mine.op}: {_size(done)}{of} after {max(t for _, t, _, _ in ranks):.0f} s on {len(ranks)} ranks; "
        f"{_size(statistics.median(r for r, _ in rates))}/s per rank (median); slowest rank {slow} "
        f"at {_size(slow_rate)}/s, in phase {where!r}"
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
