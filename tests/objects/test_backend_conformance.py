"""One conformance suite for the Backend contract (``ckstore.testing``), run against memory,
local and S3: the same suite a third-party backend runs."""

from __future__ import annotations

from ckstore.testing import BackendConformance


class TestEveryBackend(BackendConformance):
    """The ``backend`` fixture (tests/objects/conftest.py) yields each implementation in turn."""
