"""A write session's lease, kept alive by a heartbeat thread while a take runs.

GC trusts a lease only while it is fresh (reliability contract I4): a take that stops beating
(paused, partitioned) loses its pins and then fails at commit with LeaseExpiredError.
"""

from __future__ import annotations

import os
import socket
import threading

from ..errors import CkstoreError
from ..index import Index


class Lease:
    """Context manager: begin a session, heartbeat every ``seconds / 3``, end it on exit."""

    def __init__(self, index: Index, seconds: float) -> None:
        self._index = index
        self._seconds = seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: CkstoreError | None = None
        self.id = ""
        self.committed = False

    def __enter__(self) -> Lease:
        owner = f"{socket.gethostname()}:{os.getpid()}"
        self.id = self._index.begin_session(owner, self._seconds).id
        self._thread = threading.Thread(target=self._beat, name="ckstore-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                self._index.heartbeat(self.id, self._seconds)
            except CkstoreError as exc:  # expired: the commit will fail with the typed error
                self.error = exc
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.committed:
            try:
                self._index.end_session(self.id, "aborted")
            except CkstoreError:
                pass  # the lease simply expires; GC treats it as gone
