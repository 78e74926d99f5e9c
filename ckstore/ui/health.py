"""Health of snapshots (NaN/Inf counts, staleness, norms per layer), as takes record it.

All of it goes through ONE adapter, :func:`health_of`, which reads the ``health`` field of the
manifest's snapshot header as every take writes it (docs/FORMAT.md, section 7.6; parsed by
:class:`ckstore.format.health.Health`)::

    {"tensors": {key: {"nan": int, "inf": int, "norm": float | null}}, "nonfinite": int,
     "stale": [key, ...], "stale_base": {"id": ..., "step": ...},
     "replicas": {"checked": int, "diverged": {key: {"ranks": [int], ...}}}}

and returns None when the take measured nothing (a snapshot from before ckstore recorded
health, or taken with ``health=False``) or the field is malformed: the page then says "no
health recorded". The page depends on the adapter's output only.

Health needs each snapshot's manifest, so a run's series reads at most ``limit`` manifests
(evenly spread over the run, the newest always in), each parsed once per process
(:class:`HealthCache`, keyed by the immutable manifest id). Which snapshots are healthy at all
is in the index (``record.nonfinite``) without any manifest.

The norms plotted are those of one app at a time (a top-level key of the app_state): the
model's weights by default, never an optimizer's ``step`` counters (a tensor whose last key
part is ``step`` is a counter, not a weight). Layers that held NaN or Inf anywhere in the
series are always among those plotted, then the largest by norm.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

from ..format.health import Health
from ..format.manifest import Manifest
from ..index import SnapshotRecord
from ..store import Store
from .changes import layer_of
from .timeline import History

DEFAULT_LIMIT = 200
MAX_LIMIT = 2000
MAX_LAYERS = 12
"""Layers whose norm series the page plots (those with NaN/Inf, then the largest by norm in the
newest snapshot)."""
ALL_APPS = "*"
"""The ``app`` that plots every app's layers together."""
OPTIMIZER_APPS = ("optim", "optimizer", "opt", "optimizers", "scheduler", "lr_scheduler")
"""App names a run's default plot passes over: their norms are moments and counters."""
COUNTERS = ("step",)
"""Last key parts of tensors that count (optimizer steps), left out of every norm."""


def health_of(record: SnapshotRecord, manifest: Manifest) -> dict[str, Any] | None:
    """The health a snapshot recorded, normalised for the page, or None when it measured none.

    Args:
        record: The snapshot's index record (its ``nonfinite`` summary agrees with the
            manifest's figures; the page's list of runs uses the record alone).
        manifest: Its manifest; ``manifest.snapshot["health"]`` is read.

    Returns:
        ``{"tensors": {key: {"nan": int, "inf": int, "norm": float | None}},
        "stale": [key, ...], "diverged": {key: [rank, ...]}, "nan": total, "inf": total}``
        (``diverged``: replicated tensors whose copies differ between ranks, and the ranks
        whose copy differs), or None.
    """
    return _normalised(Health.from_dict((manifest.snapshot or {}).get("health")))


def _normalised(found: Health | None) -> dict[str, Any] | None:
    if found is None or found.tensors is None:
        return None
    tensors = {
        k: {"nan": t.nan, "inf": t.inf, "norm": _number(t.norm)} for k, t in found.tensors.items()
    }
    return {
        "tensors": tensors,
        "stale": sorted(found.stale or ()),
        "diverged": {k: list(d.ranks) for k, d in found.diverged.items()},
        "nan": sum(t["nan"] for t in tensors.values()),
        "inf": sum(t["inf"] for t in tensors.values()),
    }


def _number(v: Any) -> float | None:
    return (
        float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        else None
    )


class HealthCache:
    """Health per manifest id (manifests never change), least recently used out first."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, dict[str, Any] | None] = OrderedDict()

    def get(self, store: Store, record: SnapshotRecord) -> dict[str, Any] | None:
        with self._lock:
            if record.manifest_id in self._items:
                self._items.move_to_end(record.manifest_id)
                return self._items[record.manifest_id]
        value = _normalised(store.get(record.id).health)  # the header alone
        with self._lock:
            self._items[record.manifest_id] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


def pick(records: list[SnapshotRecord], limit: int) -> list[SnapshotRecord]:
    """At most ``limit`` of ``records`` (oldest first), evenly spread, the newest included."""
    if len(records) <= limit:
        return records
    step = (len(records) - 1) / (limit - 1) if limit > 1 else 0
    chosen = sorted({round(i * step) for i in range(limit)} | {len(records) - 1})
    return [records[i] for i in chosen]


def run_health(
    store: Store,
    history: History,
    cache: HealthCache,
    run: str,
    limit: int,
    app: str | None = None,
) -> dict[str, Any]:
    """The health series of one run: flags per snapshot and norms per layer over steps.

    Args:
        app: The app whose layers are plotted (:data:`ALL_APPS`: every app); None: the
            model's (:func:`default_app`).

    Returns:
        ``points`` (one per snapshot read: step, NaN/Inf counts, stale and NaN/Inf keys),
        ``norms`` (layer -> one norm per point), ``nonfinite`` (layer -> the points where it
        held NaN or Inf), ``apps`` (what ``app`` may be) and ``app`` (the one plotted).
    """
    pos = history.position()
    records = pick([r for r in history.records if r.run == run], max(1, min(limit, MAX_LIMIT)))
    found = [cache.get(store, r) for r in records]
    apps = sorted({_app(k) for h in found if h for k in h["tensors"]})
    chosen = app if app in apps or app == ALL_APPS else default_app(apps)
    points: list[dict[str, Any]] = []
    norms: dict[str, list[float | None]] = {}
    nonfinite: dict[str, list[int]] = {}
    for n, (r, h) in enumerate(zip(records, found)):
        layers, bad_layers = _layer_norms(h, chosen)
        for layer, value in layers.items():
            norms.setdefault(layer, [None] * len(records))[n] = value
        for layer in bad_layers:
            nonfinite.setdefault(layer, []).append(n)
        points.append({
            "pos": pos[r.id], "id": r.id, "step": r.step, "t": r.created_at,
            "recorded": h is not None,
            "nan": h["nan"] if h else 0, "inf": h["inf"] if h else 0,
            "stale": h["stale"] if h else [],
            "diverged": h["diverged"] if h else {},
            "bad": sorted(k for k, t in h["tensors"].items() if t["nan"] or t["inf"]) if h else [],
        })  # fmt: skip
    last = {
        layer: next((v for v in reversed(vals) if v is not None), 0.0)
        for layer, vals in norms.items()
    }
    order = sorted(last, key=lambda layer: (layer not in nonfinite, -(last[layer] or 0.0)))
    top = order[:MAX_LAYERS]
    return {
        "run": run,
        "recorded": any(p["recorded"] for p in points),
        "read": len(records),
        "points": points,
        "apps": apps,
        "app": chosen,
        "layers": len(norms),
        "norms": {layer: norms[layer] for layer in top},
        "nonfinite": {layer: nonfinite[layer] for layer in top if layer in nonfinite},
    }


def default_app(apps: list[str]) -> str:
    """The app plotted first: ``model`` where there is one, else the first that is not an
    optimizer's or a scheduler's, else every app."""
    if "model" in apps:
        return "model"
    return next((a for a in apps if a not in OPTIMIZER_APPS), ALL_APPS)


def _app(key: str) -> str:
    return key.split("/", 1)[0]


def _layer_norms(h: dict[str, Any] | None, app: str) -> tuple[dict[str, float], set[str]]:
    """L2 norm per layer of ``app`` (the root of the sum of its tensors' squared norms), and
    the layers holding NaN or Inf. Counters (:data:`COUNTERS`) are left out."""
    if h is None:
        return {}, set()
    sums: dict[str, float] = {}
    bad: set[str] = set()
    for key, t in h["tensors"].items():
        if app != ALL_APPS and _app(key) != app:
            continue
        layer, leaf = layer_of(key)
        if leaf in COUNTERS:
            continue
        if t["nan"] or t["inf"]:
            bad.add(layer)
            sums.setdefault(layer, 0.0)
        if t["norm"] is not None:
            sums[layer] = sums.get(layer, 0.0) + t["norm"] ** 2
    return {layer: math.sqrt(s) for layer, s in sums.items()}, bad
