"""Another gc at the worst moment: between a writer's new pack and its switch in the index."""

from __future__ import annotations

from typing import Any

import pytest

import ckstore
from ckstore.index.maintenance import Maintenance


def sweep_at_first_switch(monkeypatch: pytest.MonkeyPatch, other: ckstore.Store) -> list[Any]:
    """Make the first ``Maintenance.relocate_chunks`` of this process (a gc's, heal's or
    hydrate's switch to the pack it just wrote) run ``other.gc(grace_seconds=0)`` first, as a
    gc of another process would that lists the packs then; returns the list that will hold
    that gc's report. The patch is undone when the test ends."""
    real = Maintenance.relocate_chunks
    reports: list[Any] = []

    def relocate(self: Maintenance, *args: Any, **kwargs: Any) -> int:
        if not reports:
            reports.append(None)  # the other gc's own switches go straight through
            reports[0] = other.gc(grace_seconds=0, repack_below=0)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Maintenance, "relocate_chunks", relocate)
    return reports
