"""The result types of a snapshot diff: per-key ``KeyDiff`` and whole ``DiffResult``.

Every type has ``to_dict()`` giving strict JSON (no NaN or infinities; see ``_json_float``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ADDED, REMOVED, CHANGED, UNCHANGED = "added", "removed", "changed", "unchanged"
STATUSES = (ADDED, REMOVED, CHANGED, UNCHANGED)


@dataclass(frozen=True)
class NumericDiff:
    """How far apart a changed tensor's values are, over the region its changed chunks cover.

    The region is the union of the boxes of side B's chunks that side A lacks, which is also
    the union of side A's chunks that side B lacks (the sides may cut the tensor differently).

    Attributes:
        max_abs_diff: Largest ``|b - a|`` (modulus for complex dtypes).
        l2_diff: L2 norm of ``b - a``.
        l2_a: L2 norm of side A over the same elements (not the whole tensor).
        l2_b: L2 norm of side B over the same elements.
        elements: Number of elements compared (those of the changed region).
    """

    max_abs_diff: float
    l2_diff: float
    l2_a: float
    l2_b: float
    elements: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs_diff": _json_float(self.max_abs_diff),
            "l2_diff": _json_float(self.l2_diff),
            "l2_a": _json_float(self.l2_a),
            "l2_b": _json_float(self.l2_b),
            "elements": self.elements,
        }


@dataclass(frozen=True)
class KeyDiff:
    """One key of the comparison.

    Attributes:
        key: The flattened app_state key.
        status: ``added``, ``removed``, ``changed`` or ``unchanged``.
        kind: Entry kind on side B (side A for removed keys).
        dtype_a, dtype_b, shape_a, shape_b: None where the side lacks the key or it is a value.
        bytes_a, bytes_b: Logical bytes on each side (None where the side lacks the key).
        changed_chunks, total_chunks: For a changed chunked tensor of equal dtype and shape, how
            many of side B's chunks differ from side A's, out of how many.
        chunk_fraction: ``changed_chunks / total_chunks``; 1.0 when dtype, shape or kind changed
            or the tensor is stored inline; None for values.
        changed_bytes: Logical bytes of side B covered by changed chunks (a changed key only).
        reason: Why the fraction is what it is, when not a plain chunk count.
        numeric: The numeric summary, when asked for and computable.
        health_a, health_b: The take's figures for the tensor on each side (``nan``, ``inf``,
            ``norm``), where recorded.
    """

    key: str
    status: str
    kind: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    bytes_a: int | None = None
    bytes_b: int | None = None
    changed_chunks: int | None = None
    total_chunks: int | None = None
    chunk_fraction: float | None = None
    changed_bytes: int | None = None
    reason: str | None = None
    numeric: NumericDiff | None = None
    health_a: dict[str, Any] | None = None
    health_b: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key,
            "status": self.status,
            "kind": self.kind,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": None if self.shape_a is None else list(self.shape_a),
            "shape_b": None if self.shape_b is None else list(self.shape_b),
            "bytes_a": self.bytes_a,
            "bytes_b": self.bytes_b,
        }
        if self.status == CHANGED:
            d.update(
                changed_chunks=self.changed_chunks,
                total_chunks=self.total_chunks,
                chunk_fraction=self.chunk_fraction,
                changed_bytes=self.changed_bytes,
                reason=self.reason,
                numeric=None if self.numeric is None else self.numeric.to_dict(),
            )
        if self.health_a is not None or self.health_b is not None:
            d.update(health_a=self.health_a, health_b=self.health_b)
        return d


@dataclass(frozen=True)
class SnapshotSide:
    """Which snapshot one side of the diff is."""

    ref: str
    id: str
    run: str
    step: int | None
    health: dict[str, Any] | None = None
    """What its take found: ``nonfinite`` (NaN + Inf elements) and ``stale`` (keys), each None
    when not recorded; None for a snapshot taken before ckstore recorded health."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "id": self.id,
            "run": self.run,
            "step": self.step,
            "health": self.health,
        }


@dataclass(frozen=True)
class DeltaSavings:
    """The chunks side B holds that side A lacks, and how many of them are stored as deltas.

    Attributes:
        new_chunks: Chunks of B not in A.
        new_raw_bytes, new_stored_bytes: Their raw size and stored length.
        chunks: How many of them are deltas; ``raw_bytes``/``stored_bytes`` of those.
    """

    new_chunks: int = 0
    new_raw_bytes: int = 0
    new_stored_bytes: int = 0
    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """Raw bytes of the delta chunks that their deltas did not store."""
        return self.raw_bytes - self.stored_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_chunks": self.new_chunks,
            "new_raw_bytes": self.new_raw_bytes,
            "new_stored_bytes": self.new_stored_bytes,
            "chunks": self.chunks,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "saved_bytes": self.saved_bytes,
        }


@dataclass(frozen=True)
class DiffResult:
    """The comparison of snapshot A (older, usually) with snapshot B, key by key.

    ``b_deltas`` counts what B stores beyond A, deltas included (see :class:`DeltaSavings`).
    """

    a: SnapshotSide
    b: SnapshotSide
    keys: tuple[KeyDiff, ...]
    numeric: bool = False
    b_deltas: DeltaSavings = field(default_factory=DeltaSavings)
    _by_status: dict[str, tuple[KeyDiff, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = {s: tuple(k for k in self.keys if k.status == s) for s in STATUSES}
        object.__setattr__(self, "_by_status", groups)

    @property
    def added(self) -> tuple[KeyDiff, ...]:
        return self._by_status[ADDED]

    @property
    def removed(self) -> tuple[KeyDiff, ...]:
        return self._by_status[REMOVED]

    @property
    def changed(self) -> tuple[KeyDiff, ...]:
        return self._by_status[CHANGED]

    @property
    def unchanged(self) -> tuple[KeyDiff, ...]:
        return self._by_status[UNCHANGED]

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def __getitem__(self, key: str) -> KeyDiff:
        for k in self.keys:
            if k.key == key:
                return k
        raise KeyError(key)

    @property
    def counts(self) -> dict[str, int]:
        return {s: len(self._by_status[s]) for s in STATUSES}

    @property
    def bytes(self) -> dict[str, int]:
        """Logical bytes per status (side B's size; side A's for removed keys)."""
        out = {
            ADDED: sum(k.bytes_b or 0 for k in self.added),
            REMOVED: sum(k.bytes_a or 0 for k in self.removed),
            CHANGED: sum(k.bytes_b or 0 for k in self.changed),
            UNCHANGED: sum(k.bytes_b or 0 for k in self.unchanged),
        }
        out["changed_chunk_bytes"] = sum(k.changed_bytes or 0 for k in self.changed)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``json.dumps`` works on it)."""
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "numeric": self.numeric,
            "counts": self.counts,
            "bytes": self.bytes,
            "keys": [k.to_dict() for k in self.keys],
            "b_deltas": self.b_deltas.to_dict(),
        }


def _json_float(x: float) -> float | str:
    """Finite floats as they are; NaN and infinities as strings (strict JSON has neither)."""
    return x if math.isfinite(x) else str(x)
