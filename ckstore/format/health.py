"""What a take found in the state it stored: the ``health`` field of the snapshot header.

Shape (docs/FORMAT.md, section 7.6)::

    "health": {
      "tensors":    {"<key>": {"nan": 0, "inf": 0, "norm": 12.5}, ...},
      "nonfinite":  0,
      "stale":      ["<key>", ...],                       (only when checked)
      "stale_base": {"id": "<snapshot id>", "step": 100}  (only when checked)
      "replicas":   {"checked": 12, "diverged": {"<key>": {"ranks": [2],
                     "regions": [[[0, 0], [64, 8]]], "region_count": 1}}}  (only when compared)
    }

``tensors`` has one record per floating-point (or complex) tensor: its NaN and Inf element
counts and the L2 norm of its finite elements (``null`` past the float range). Integer and
bool tensors hold no NaN or Inf and their norm says nothing about training, so they have no
record. ``nonfinite`` is the sum of every ``nan`` and ``inf``: 0 is a healthy snapshot, and
the index keeps it beside the snapshot (``snapshots.nonfinite``). Both are absent when the
take did not measure (``health=False``): unknown, not healthy. ``stale`` lists the tensors
that should have changed since ``stale_base``, the run's previous snapshot at a lower step,
and did not (same chunk ids); it is absent when there was nothing to compare with.
``replicas`` says what a distributed take found comparing the copies of its replicated tensors
(a DDP module's, keys a ``replicated=`` glob names) between ranks: how many it compared, and for
each whose copies differ, the ranks whose copy is not the majority's and the chunk regions
(grid boxes) where any rank differs; absent when nothing was compared (one process). The index
keeps the number of those tensors (``snapshots.diverged``).

This module is torch-free: reading history (``ckstore show``, ``log``, ``ckstore ui``) parses
it without importing torch. The take side is :mod:`ckstore.engine.take.guard`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

POLICIES = ("warn", "raise", "ignore")
"""What a take does about a finding (``on_stale``, ``on_nonfinite``, ``on_divergence``)."""

MAX_REGIONS = 16
"""Regions recorded per diverged tensor (``region_count`` says how many differ in all)."""

_INDEX = re.compile(r"(?<=[./])\d+(?=[./]|$)")


@dataclass(frozen=True)
class TensorHealth:
    """One tensor's figures: NaN and Inf elements, and the L2 norm of its finite elements
    (None when it does not fit a float)."""

    nan: int = 0
    inf: int = 0
    norm: float | None = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"nan": self.nan, "inf": self.inf, "norm": self.norm}


@dataclass(frozen=True)
class Divergence:
    """Where one replicated tensor's copies differ between ranks.

    Attributes:
        ranks: the ranks whose copy differs from the majority's (for a DTensor shard, the
            majority of the ranks holding the same box; on a tie, from the copy of the lowest
            rank among the largest groups), sorted.
        regions: ``(offsets, sizes)`` of the chunk regions where some rank's copy differs (grid
            boxes; for a DTensor shard, grid boxes cut by its box), at most
            :data:`MAX_REGIONS` of them, in order.
        region_count: how many regions differ in all.
    """

    ranks: tuple[int, ...]
    regions: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    region_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "regions": [[list(o), list(s)] for o, s in self.regions],
            "region_count": self.region_count,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Divergence | None:
        """The record, or None if malformed."""
        if not isinstance(raw, dict):
            return None
        ranks, regions, count = raw.get("ranks"), raw.get("regions", []), raw.get("region_count")
        if not isinstance(ranks, list) or not all(_count(r) for r in ranks):
            return None
        if not _count(count) or not isinstance(regions, list):
            return None
        boxes = []
        for box in regions:
            if not (
                isinstance(box, list)
                and len(box) == 2
                and all(isinstance(p, list) and all(_count(x) for x in p) for p in box)
            ):
                return None
            boxes.append((tuple(box[0]), tuple(box[1])))
        return cls(tuple(ranks), tuple(boxes), count)


@dataclass(frozen=True)
class Replicas:
    """What comparing replicated tensors between ranks found: how many were compared, and
    those whose copies differ (key -> :class:`Divergence`)."""

    checked: int
    diverged: Mapping[str, Divergence] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "diverged": {k: d.to_dict() for k, d in sorted(self.diverged.items())},
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Replicas | None:
        """The record, or None if malformed."""
        if not isinstance(raw, dict) or not _count(raw.get("checked")):
            return None
        found = raw.get("diverged", {})
        if not isinstance(found, dict):
            return None
        diverged = {}
        for key, d in found.items():
            parsed = Divergence.from_dict(d)
            if not isinstance(key, str) or parsed is None:
                return None
            diverged[key] = parsed
        return cls(raw["checked"], diverged)


@dataclass(frozen=True)
class Health:
    """The ``health`` header field, parsed (see the module docstring).

    Attributes:
        tensors: key -> its figures (floating-point and complex tensors only); None when the
            take did not measure them.
        stale: keys that should have changed since ``stale_base`` and did not; None when
            nothing was compared (no earlier snapshot of the run at a lower step).
        stale_base: ``{"id", "step"}`` of the snapshot compared with, or None.
        replicas: what comparing replicated tensors between ranks found; None when nothing
            was compared (one process, or no replicated tensor).
    """

    tensors: Mapping[str, TensorHealth] | None = field(default_factory=dict)
    stale: tuple[str, ...] | None = None
    stale_base: Mapping[str, Any] | None = None
    replicas: Replicas | None = None

    @property
    def nonfinite(self) -> int | None:
        """NaN and Inf elements in every tensor together (0: healthy; None: not measured)."""
        return None if self.tensors is None else sum(t.nan + t.inf for t in self.tensors.values())

    @property
    def bad_keys(self) -> list[str]:
        """Keys of the tensors holding a NaN or an Inf, sorted."""
        return sorted(k for k, t in (self.tensors or {}).items() if t.nan or t.inf)

    @property
    def diverged(self) -> dict[str, Divergence]:
        """Replicated tensors whose copies differ between ranks (key -> where), by key."""
        return dict(sorted((self.replicas.diverged if self.replicas else {}).items()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tensors is not None:
            out["tensors"] = {k: t.to_dict() for k, t in sorted(self.tensors.items())}
            out["nonfinite"] = self.nonfinite
        if self.stale is not None:
            out["stale"] = sorted(self.stale)
            out["stale_base"] = dict(self.stale_base or {})
        if self.replicas is not None:
            out["replicas"] = self.replicas.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> Health | None:
        """The health recorded in a header, or None if absent or malformed (a reader treats
        a snapshot without a usable record as unknown, never as unhealthy)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tensors", {}), dict):
            return None
        found: dict[str, TensorHealth] = {}
        for key, t in raw.get("tensors", {}).items():
            if not isinstance(key, str) or not isinstance(t, dict):
                return None
            nan, inf, norm = t.get("nan"), t.get("inf"), t.get("norm")
            if not _count(nan) or not _count(inf) or not (norm is None or _finite(norm)):
                return None
            found[key] = TensorHealth(nan, inf, None if norm is None else float(norm))
        stale = raw.get("stale")
        if stale is not None and (
            not isinstance(stale, list) or not all(isinstance(k, str) for k in stale)
        ):
            return None
        base = raw.get("stale_base")
        replicas = Replicas.from_dict(raw["replicas"]) if "replicas" in raw else None
        if "replicas" in raw and replicas is None:
            return None
        return cls(
            found if "tensors" in raw else None,
            None if stale is None else tuple(stale),
            dict(base) if isinstance(base, dict) else None,
            replicas,
        )


def of_header(header: Mapping[str, Any] | None) -> Health | None:
    """The health a snapshot header records, or None."""
    return Health.from_dict((header or {}).get("health"))


def summary(header: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """What the index keeps of a header's health: (NaN + Inf elements, stale tensors,
    replicated tensors whose copies differ between ranks), each None when not recorded."""
    health = of_header(header)
    if health is None:
        return None, None, None
    return (
        health.nonfinite,
        None if health.stale is None else len(health.stale),
        None if health.replicas is None else len(health.replicas.diverged),
    )


def key_pattern(key: str) -> str:
    """``key`` with its numeric path parts as ``*``: ``model/layers.3.weight`` ->
    ``model/layers.*.weight``, ``optim/state/12/exp_avg`` -> ``optim/state/*/exp_avg``; the
    layers of one kind share a pattern, so a finding is reported once per kind."""
    return _INDEX.sub("*", key)


def by_pattern(keys: Iterable[str]) -> dict[str, list[str]]:
    """``keys`` grouped by :func:`key_pattern`, patterns and keys sorted."""
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        groups.setdefault(key_pattern(key), []).append(key)
    return dict(sorted(groups.items()))


def describe(keys: Iterable[str], limit: int = 6) -> str:
    """A short text naming ``keys`` by pattern: ``model/layers.*.weight (12 tensors), ...``."""
    groups = by_pattern(keys)
    parts = [ks[0] if len(ks) == 1 else f"{p} ({len(ks)} tensors)" for p, ks in groups.items()]
    more = f" and {len(parts) - limit} more patterns" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def _count(v: Any) -> TypeGuard[int]:
    return type(v) is int and v >= 0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
