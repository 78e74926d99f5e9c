"""The store's history as JSON-able views: every snapshot in one columnar table, and forks.

The overview comes from the SQL index alone: one query lists the snapshots (a store of 10,000
costs one round trip, not 10,000) with what their takes found (NaN/Inf counts and stale
tensors, marked on the lineage), one lists the tags. The fork edges cost one manifest header
and one bounded index query per run (:meth:`ckstore.Store.fork_sources`), computed once per set
of runs (:class:`ForkCache`).

What the lineage graph shows:

- **parent edges**: ``parent_id`` of each snapshot, which the index sets to the run's latest
  snapshot at commit time (deleting a snapshot re-links its children to its parent), so each
  run is one chain;
- **fork edges**, for the first snapshot of each run (the root of its chain): the snapshot its
  take recorded as the one its state came from (``take(..., forked_from=ref)``, or the
  snapshot a restore of the taking process loaded: ``snap.forked_from``), else the earlier
  snapshot of another run that holds the most of a sample of its chunks, or of the delta bases
  of its chunks (a fine-tune with a frozen backbone keeps the base's chunks; one taken with
  ``delta_base=`` stores deltas against them). Ties go to the earliest holder: the base the
  others share it from, never a sibling fine-tune taken later. A fine-tune that changed every
  tensor, stored no deltas and recorded no fork shows no edge.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..index import SnapshotRecord
from ..store import Store

FORK_SAMPLE = 32
"""Chunks of a run's first snapshot sampled to find where it forked from."""


@dataclass(frozen=True)
class History:
    """Snapshots oldest first, with the lookups the views need."""

    records: tuple[SnapshotRecord, ...]
    tags: dict[str, str]
    """Tag name -> snapshot id."""

    def position(self) -> dict[str, int]:
        """Snapshot id -> its position in ``records``."""
        return {r.id: i for i, r in enumerate(self.records)}

    def runs(self) -> list[str]:
        """Run names, in the order their first snapshots were taken."""
        return list(dict.fromkeys(r.run for r in self.records))

    def roots(self) -> list[SnapshotRecord]:
        """The first snapshot of each run (no parent)."""
        return [r for r in self.records if r.parent_id is None]


def load_history(store: Store) -> History:
    """All snapshots (oldest first) and tags, in two index queries."""
    records = [s.record for s in store.log()]
    records.reverse()
    return History(tuple(records), store.tags())


def ref_of(r: SnapshotRecord) -> str:
    """A ref people read, and ``store.get`` resolves: the name, ``run@step``, or the run and a
    short id in the display form ``run (0123456789ab)`` (a snapshot without a step)."""
    if r.name:
        return r.name
    return f"{r.run}@{r.step}" if r.step is not None else f"{r.run} ({r.id[:12]})"


def overview(store: Store, history: History, workdir: str | None = None) -> dict[str, Any]:
    """The first view the page draws: every snapshot as parallel arrays (compact for 10,000).

    ``snaps.parent`` holds positions (-1: none), ``snaps.run`` positions in ``runs``;
    ``snaps.nonfinite``, ``snaps.stale`` and ``snaps.diverged`` what each take found (NaN/Inf
    elements, stale tensors, replicated tensors whose copies differed; null: not recorded); ``tags`` maps a tag to the position of its snapshot;
    ``store.shown`` the store as the header names it (:func:`shown_url`, from ``workdir``).
    """
    pos = history.position()
    runs = history.runs()
    run_pos = {name: i for i, name in enumerate(runs)}
    recs = history.records
    return {
        "store": {
            "url": store.url,
            "shown": shown_url(store.url, workdir),
            "index": store.index_url,
            "snapshots": len(recs),
        },
        "runs": runs,
        "snaps": {
            "id": [r.id for r in recs],
            "run": [run_pos[r.run] for r in recs],
            "step": [r.step for r in recs],
            "name": [r.name for r in recs],
            "t": [r.created_at for r in recs],
            "parent": [pos.get(r.parent_id, -1) if r.parent_id else -1 for r in recs],
            "logical": [r.logical_bytes for r in recs],
            "new": [r.new_bytes for r in recs],
            "newChunks": [r.new_chunks for r in recs],
            "reused": [r.reused_chunks for r in recs],
            "nonfinite": [r.nonfinite for r in recs],
            "stale": [r.stale for r in recs],
            "diverged": [r.diverged for r in recs],
        },
        "tags": {name: pos[sid] for name, sid in sorted(history.tags.items()) if sid in pos},
    }


def shown_url(url: str, workdir: str | None = None) -> str:
    """How the page's header names the store: a local path relative to ``workdir`` (default:
    the folder ``ckstore ui`` runs in) when it is below it (``ckpts``), else under ``~`` when
    below the home folder, else the URL as it is (the header's tooltip holds the whole URL)."""
    if "://" in url or not os.path.isabs(url):
        return url
    here = os.path.abspath(workdir or os.getcwd())
    if url == here or url.startswith(here + os.sep):
        return os.path.relpath(url, here)
    home = os.path.expanduser("~")
    if home not in ("", "/") and url.startswith(home + os.sep):
        return "~" + url[len(home) :]
    return url


class ForkCache:
    """Fork edges, recomputed only when the set of run roots changes (they rarely do)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, ...] | None = None
        self._edges: list[dict[str, Any]] = []

    def edges(self, store: Store, history: History) -> list[dict[str, Any]]:
        """One edge per forked run (:func:`fork_edges`)."""
        roots = history.roots()
        key = tuple(sorted(r.id for r in roots))
        with self._lock:
            if key != self._key:
                self._edges = fork_edges(store, history, roots)
                self._key = key
            return list(self._edges)


def fork_edges(
    store: Store, history: History, roots: Sequence[SnapshotRecord]
) -> list[dict[str, Any]]:
    """Where each run's first snapshot forked from (see the module docstring).

    Edges are ``{"from", "to", "shared", "sampled", "recorded"}``: ``recorded`` when the take
    named its source, else ``shared`` of ``sampled`` chunks tell how sure the guess is.
    """
    pos = history.position()
    edges = []
    guess = []
    for root in roots:
        source = store.get(root.id).forked_from
        if source in pos and pos[source] < pos[root.id]:
            edges.append(
                {"from": pos[source], "to": pos[root.id], "shared": None, "sampled": None,
                 "recorded": True}
            )  # fmt: skip
        else:
            guess.append(root)
    found = store.fork_sources([r.id for r in guess], sample=FORK_SAMPLE)
    for root in guess:
        holders = [
            h for h in found.get(root.id, []) if pos.get(h.snapshot_id, len(pos)) < pos[root.id]
        ]
        if not holders:
            continue
        best = max(h.chunks for h in holders)
        pick = min((h for h in holders if h.chunks == best), key=lambda h: pos[h.snapshot_id])
        edges.append(
            {"from": pos[pick.snapshot_id], "to": pos[root.id], "shared": best,
             "sampled": FORK_SAMPLE, "recorded": False}
        )  # fmt: skip
    return edges
