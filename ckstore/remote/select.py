"""Which snapshots and tags a push or pull sends, from the refs given (git's refspecs, simplified).

- No ref: every run (every snapshot of each) and every tag.
- A tag: the snapshot it names, and the tag.
- A run (a name that is no tag and no snapshot's name): every snapshot of the run.
- Anything else the index resolves as a ref (``run@step``, a snapshot name, an id prefix):
  that snapshot alone.

Snapshots come out run by run (runs by name), each run's in commit order, so the destination
commits every snapshot after the ones it followed here: its parent there is its run's newest
snapshot at that moment, the same rule as for any take (docs/RELIABILITY.md, I1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..index import SnapshotRecord

if TYPE_CHECKING:
    from ..engine.interfaces import HistoryIndex


@dataclass
class Selection:
    """What to send: snapshots in the order to commit them, and tags (name -> snapshot id)."""

    snapshots: list[SnapshotRecord] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)

    def tags_of(self, snapshot_id: str) -> list[str]:
        """The tags to send that name ``snapshot_id``."""
        return sorted(n for n, s in self.tags.items() if s == snapshot_id)


def select(index: HistoryIndex, refs: Sequence[str]) -> Selection:
    """The snapshots and tags ``refs`` name in ``index`` (module docstring).

    Raises:
        SnapshotNotFoundError: a ref names nothing (the message lists what was tried).
        InvalidInputError: a ref is malformed or an ambiguous id prefix.
    """
    runs = set(index.list_runs())
    tags = {t.name: t.snapshot_id for t in index.list_tags()}
    chosen: dict[str, SnapshotRecord] = {}
    out = Selection()
    if not refs:
        for run in sorted(runs):
            chosen.update((s.id, s) for s in index.list_snapshots(run=run))
        out.tags = dict(tags)
    for ref in refs:
        whole = _whole_id(index, ref)
        if whole is not None:  # a whole id names that snapshot first (index/_resolve.py)
            chosen[whole.id] = whole
            continue
        if ref in tags:
            out.tags[ref] = tags[ref]
            rec = index.get_snapshot(tags[ref])
            chosen[rec.id] = rec
            continue
        rec = index.resolve(ref)
        if ref in runs and rec.name != ref:
            chosen.update((s.id, s) for s in index.list_snapshots(run=ref))
        else:
            chosen[rec.id] = rec
    by_run: dict[str, list[SnapshotRecord]] = {}
    for rec in chosen.values():
        by_run.setdefault(rec.run, []).append(rec)
    seq = {s.id: i for run in by_run for i, s in enumerate(reversed(index.list_snapshots(run=run)))}
    for run in sorted(by_run):
        out.snapshots += sorted(by_run[run], key=lambda s: seq.get(s.id, 0))
    return out


def _whole_id(index: HistoryIndex, ref: str) -> SnapshotRecord | None:
    """The snapshot whose whole id is ``ref``, or None."""
    from ..errors import SnapshotNotFoundError

    try:
        rec = index.get_snapshot(ref)
    except SnapshotNotFoundError:
        return None
    return rec if rec.id == ref else None
