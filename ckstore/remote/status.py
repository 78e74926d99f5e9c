"""Where each snapshot is: ``local``, ``pushing`` or ``pushed`` (what ``log`` and ``show`` print).

- ``pushed``: a remote holds it (for a two-tier store: its tier remote does).
- ``pushing``: the store has a persistent tier that does not hold it yet; the uploader of a
  store opened with ``push_to`` sends it (retention keeps it meanwhile).
- ``local``: no remote holds it, and no tier waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.interfaces import RemoteIndex


@dataclass(frozen=True)
class PushStatus:
    """One snapshot's state and the remotes known to hold it."""

    state: str
    remotes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "remotes": list(self.remotes)}


def statuses(index: RemoteIndex) -> dict[str, PushStatus]:
    """Snapshot id -> :class:`PushStatus`, for every snapshot (from the index alone)."""
    tiers = {r.name for r in index.list_remotes() if r.tier}
    held = index.remote_holdings()
    out = {}
    for snap in index.list_snapshots():
        where = held.get(snap.id, set())
        if tiers:
            state = "pushed" if tiers <= where else "pushing"
        else:
            state = "pushed" if where else "local"
        out[snap.id] = PushStatus(state, tuple(sorted(where)))
    return out
