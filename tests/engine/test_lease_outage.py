"""A lease's heartbeat across an index that is out of reach for a while (a PostgreSQL server
restarting, a network blip). Before, the heartbeat thread stopped for good at the first failed
renewal, so a take, compaction or push outlived its lease and failed although the index came
back well within it. Now it beats again while the lease may still run; only the index saying
the lease is gone, or an outage as long as the lease, stops it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from ckstore.engine.lease import Lease
from ckstore.errors import IndexDatabaseError, LeaseExpiredError


class FlakyIndex:
    """Heartbeats fail with ``IndexDatabaseError`` while ``down`` is set; the lease runs out
    (``LeaseExpiredError``) once no heartbeat got through for ``seconds``."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.beats = 0
        self.last = time.monotonic()
        self.seconds = 0.0

    def begin_session(self, owner: str, seconds: float) -> Any:
        self.seconds = seconds
        return SimpleNamespace(id="s1")

    def heartbeat(self, session_id: str, seconds: float) -> None:
        if self.down.is_set():
            raise IndexDatabaseError("the index is out of reach (connection refused)")
        if time.monotonic() - self.last > self.seconds:
            raise LeaseExpiredError(f"write session {session_id} expired")
        self.beats += 1
        self.last = time.monotonic()

    def end_session(self, session_id: str, state: str) -> None:
        pass


def test_a_short_outage_of_the_index_does_not_end_the_lease() -> None:
    index = FlakyIndex()
    with Lease(index, seconds=0.6) as lease:  # type: ignore[arg-type]
        time.sleep(0.45)
        index.down.set()
        time.sleep(0.35)  # two failed beats, less than the lease
        index.down.clear()
        time.sleep(0.6)
        assert lease.error is None
        assert index.beats >= 3  # it beats again after the outage


def test_an_outage_as_long_as_the_lease_ends_it() -> None:
    index = FlakyIndex()
    with Lease(index, seconds=0.3) as lease:  # type: ignore[arg-type]
        index.down.set()
        deadline = time.monotonic() + 5
        while lease.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert isinstance(lease.error, IndexDatabaseError)
