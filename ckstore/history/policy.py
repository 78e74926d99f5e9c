"""Retention policies: which snapshots a ``gc`` forgets (the analogue of restic ``forget``)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..format.limits import check_int, check_number
from ..index import SnapshotRecord

if TYPE_CHECKING:
    from ..engine.interfaces import HistoryIndex

MAX_SECONDS = 1e12
"""Durations (grace period, older_than) are at most about 31,000 years: finite, comparable."""


@dataclass(frozen=True)
class Policy:
    """Keep rules; a snapshot is dropped only if it is eligible and no rule keeps it.

    Attributes:
        keep_last: keep the N newest snapshots of each run: the N highest steps where every
            snapshot of the run has a step (several hosts may commit one run's steps out of
            order, and a pull brings older steps in later), else the N last committed; with
            N >= 1 the run's last commit too (what ``get(run)`` resumes from: a run rewound
            to an earlier step and trained on has its newest state at lower steps).
        keep_every_steps: keep snapshots whose step is a multiple of N.
        keep_tagged: keep every tagged snapshot.
        older_than: only snapshots older than this many seconds are eligible.
        runs: only snapshots of these runs are eligible (None: all runs).
        keep_healthy: keep each run's newest healthy snapshot (its take counted no NaN or
            Inf, found no stale tensor and no replicas that disagree:
            ``SnapshotRecord.healthy``), so a run that went wrong can always be rolled back
            (``run@healthy``).
        keep_best: keep the N best snapshots of each run by ``metric`` (Lightning's
            ``save_top_k``, the Trainer's ``load_best_model_at_end``); snapshots whose
            metadata lacks it, or holds something other than a finite number, are not ranked
            (other rules may keep them). Ties go to the newer snapshot.
        metric: the metadata key ``keep_best`` ranks by (``"loss"``, ``"eval_accuracy"``); a
            ``.`` reaches into nested objects (``"eval.loss"``) when no key has the whole name.
        mode: ``"min"`` (default: lower is better, as a loss) or ``"max"`` (an accuracy).
    """

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_tagged: bool = True
    older_than: float | None = None
    runs: tuple[str, ...] | None = None
    keep_healthy: bool = True
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            check_int("gc: keep_last", self.keep_last, 0)
        if self.keep_every_steps is not None:
            check_int("gc: keep_every_steps", self.keep_every_steps, 1)
        if self.older_than is not None:
            check_number("gc: older_than (seconds)", self.older_than, 0.0, MAX_SECONDS)
        if self.runs is not None and not all(isinstance(r, str) for r in self.runs):
            raise InvalidInputError(f"gc: runs must be run names (str), got {list(self.runs)!r}")
        if self.keep_best is not None:
            check_int("gc: keep_best", self.keep_best, 0)
            if not isinstance(self.metric, str) or not self.metric:
                raise InvalidInputError(
                    "gc: keep_best needs the metadata key to rank by: pass metric='loss' "
                    "(`ckstore gc --keep-best N --metric loss`)"
                )
        elif self.metric is not None:
            raise InvalidInputError(
                f"gc: metric={self.metric!r} ranks snapshots for keep_best: pass keep_best=N too"
            )
        if self.mode not in MODES:
            raise InvalidInputError(
                f"gc: mode must be 'min' (lower is better) or 'max', got {self.mode!r}"
            )

    @property
    def forgets_anything(self) -> bool:
        """With no keep_last/keep_every_steps/older_than, a gc only prunes."""
        return (
            self.keep_last is not None
            or self.keep_every_steps is not None
            or self.older_than is not None
            or self.keep_best is not None
        )

    def select(
        self,
        snapshots: Sequence[SnapshotRecord],
        tagged: set[str],
        now: float | None = None,
        heads: Heads | None = None,
    ) -> list[SnapshotRecord]:
        """Return the snapshots to drop, given all snapshots (newest first) and tagged ids.

        ``heads``: each run's last commit and newest healthy snapshot by commit order (what
        ``get(run)`` and ``run@healthy`` find: :func:`heads_of`); None takes them from the
        order of ``snapshots``, which across runs is by the takes' clocks, not commit order.
        """
        if not self.forgets_anything:
            return []
        now = time.time() if now is None else now
        rank = _ranks(snapshots)
        best = self._best(snapshots)
        if heads is None:
            heads = Heads({}, {})
            for s in snapshots:
                heads.latest.setdefault(s.run, s.id)
                if s.healthy:
                    heads.healthy.setdefault(s.run, s.id)
        latest, healthy = heads.latest, heads.healthy
        drop = []
        for s in snapshots:
            position = rank[s.id]
            if self.runs is not None and s.run not in self.runs:
                continue
            if self.older_than is not None and now - s.created_at < self.older_than:
                continue
            if self.keep_tagged and s.id in tagged:
                continue
            if self.keep_healthy and healthy.get(s.run) == s.id:
                continue
            if self.keep_last is not None and position < self.keep_last:
                continue
            if self.keep_last and latest[s.run] == s.id:  # a run rewound to an earlier step
                continue
            if self.keep_every_steps and s.step is not None and s.step % self.keep_every_steps == 0:
                continue
            if s.id in best:
                continue
            drop.append(s)
        return drop

    def _best(self, snapshots: Sequence[SnapshotRecord]) -> set[str]:
        """The ids ``keep_best`` keeps: each run's N best by ``metric`` (newest first on ties;
        ``snapshots`` come newest first)."""
        if not self.keep_best or self.metric is None:
            return set()
        sign = 1.0 if self.mode == "min" else -1.0
        ranked: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        for i, s in enumerate(snapshots):
            value = metric_of(s.metadata, self.metric)
            if value is not None:
                ranked[s.run].append((sign * value, i, s.id))
        return {sid for items in ranked.values() for _, _, sid in sorted(items)[: self.keep_best]}


@dataclass(frozen=True)
class Heads:
    """Each run's last commit (what ``get(run)`` resumes from) and newest healthy snapshot
    (what ``run@healthy`` finds), by commit order: run -> snapshot id."""

    latest: dict[str, str]
    healthy: dict[str, str]


def heads_of(index: HistoryIndex, runs: Iterable[str]) -> Heads:
    """The :class:`Heads` of ``runs`` as the index orders their commits."""
    out = Heads({}, {})
    for run in runs:
        for kept, healthy in ((out.latest, False), (out.healthy, True)):
            found = index.list_snapshots(run, 1, healthy=healthy)
            if found:
                kept[run] = found[0].id
    return out


MODES = ("min", "max")
"""How ``keep_best`` ranks: lower is better, or higher is."""


def metric_of(metadata: Mapping[str, Any], metric: str) -> float | None:
    """The finite number ``metadata`` records as ``metric``: the key itself, else a dotted path
    into nested objects; None when absent or not a finite number (bools are not numbers)."""
    value: Any = metadata.get(metric, _ABSENT)
    if value is _ABSENT:
        value = metadata
        for part in metric.split("."):
            value = value.get(part, _ABSENT) if isinstance(value, Mapping) else _ABSENT
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


_ABSENT = object()


def _ranks(snapshots: Sequence[SnapshotRecord]) -> dict[str, int]:
    """Snapshot id -> its place among its run's snapshots, the newest 0: by step (ties by
    commit order) where every snapshot of the run has one, else by commit order (``snapshots``
    come newest first)."""
    by_run: dict[str, list[tuple[int, SnapshotRecord]]] = defaultdict(list)
    for i, s in enumerate(snapshots):
        by_run[s.run].append((i, s))
    out: dict[str, int] = {}
    for items in by_run.values():
        if all(s.step is not None for _, s in items):
            items = sorted(items, key=lambda p: (-(p[1].step or 0), p[0]))
        for place, (_, s) in enumerate(items):
            out[s.id] = place
    return out
