"""A counting HTTP proxy on loopback in front of the benchmark's S3 server: the bytes a client
sends to the server (request bodies, as the server receives them), by method.

It is the tests' fault proxy (``tests/support/faultproxy.py``) with no fault scheduled, each
request forwarded unchanged (headers too, so signatures verify), and every body counted.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from .util import ROOT


def _faultproxy() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.support import faultproxy

    return faultproxy


def counting_proxy(upstream_url: str) -> Any:
    """A started proxy to ``upstream_url``; ``sent()`` the request body bytes so far by method,
    ``zero()`` starts counting again, ``stop()`` ends it."""
    base = _faultproxy().FaultProxy

    class CountingProxy(base):  # type: ignore[misc, valid-type]
        def __init__(self, url: str) -> None:
            super().__init__(url)
            self._counts: dict[str, int] = {}
            self._count_lock = threading.Lock()

        def _record(self, request: Any, fault: Any, status: Any) -> None:
            super()._record(request, fault, status)
            method = request.start.split(" ")[0]
            with self._count_lock:
                self._counts[method] = self._counts.get(method, 0) + len(request.body or b"")

        def sent(self) -> dict[str, int]:
            with self._count_lock:
                return dict(self._counts)

        def zero(self) -> None:
            with self._count_lock:
                self._counts = {}
            with self._lock:
                self.events = []

    return CountingProxy(upstream_url).start()
