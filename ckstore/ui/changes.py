"""What changed between two snapshots, per tensor and per layer (the page's heat map).

Built on :meth:`ckstore.Store.diff`: which keys were added, removed, changed or left alone
comes from the index (unchanged tensors have the same chunk ids and are greyed without reading
anything); with ``numeric`` the changed chunks of both sides are read (verified) and each
changed tensor gets its relative change ``l2(b - a) / l2(a)`` and its largest absolute
difference, over the elements of its changed chunks. Only that path imports torch.

A key's layer is the key without its last component: ``model/layers.3.mlp.fc1.weight`` is
tensor ``weight`` of layer ``model/layers.3.mlp.fc1``; ``optim/state/0/exp_avg`` is
``exp_avg`` of ``optim/state/0``. Layers keep the order of their first key in snapshot B.
"""

from __future__ import annotations

import math
from typing import Any

from ..history.diff_result import CHANGED, DiffResult, KeyDiff
from ..store import Store

STATUS_RANK = {"unchanged": 0, "added": 1, "removed": 1, "changed": 2}


def layer_of(key: str) -> tuple[str, str]:
    """``(layer, leaf)``: the key split at its last ``.`` or ``/``."""
    cut = max(key.rfind("."), key.rfind("/"))
    if cut <= 0:
        return "", key
    return key[:cut], key[cut + 1 :]


def relative_change(k: KeyDiff) -> float | None:
    """``l2_diff / l2_a`` over the changed chunks (``l2_b`` when side A is all zeros);
    None without a numeric summary; NaN when either side holds NaN (or the measure is NaN),
    infinity when infinities make it unmeasurable. The page shows both apart from any
    finite change, however large."""
    n = k.numeric
    if n is None:
        return None
    scale = n.l2_a or n.l2_b
    if any(h and h.get("nan") for h in (k.health_a, k.health_b)) or any(
        math.isnan(v) for v in (n.l2_diff, scale)
    ):
        return math.nan
    if not all(math.isfinite(v) for v in (n.l2_diff, scale)):
        return math.inf
    if scale == 0:
        return 0.0 if n.l2_diff == 0 else math.inf
    return n.l2_diff / scale


def compare(store: Store, a: str, b: str, numeric: bool) -> dict[str, Any]:
    """The diff of refs ``a`` and ``b`` as the page draws it: sides, counts, keys, layers.

    ``keys`` rows are lists (compact for 1,000s of tensors), named by ``columns``.

    Raises:
        SnapshotNotFoundError: a ref names nothing.
        InvalidInputError: a ref is malformed or an ambiguous id prefix.
        CorruptionError: a manifest or (with ``numeric``) a chunk is damaged.
    """
    result = store.diff(a, b, numeric=numeric)
    rows = [_row(k) for k in result.keys]
    return {
        "a": result.a.to_dict(),
        "b": result.b.to_dict(),
        "numeric": numeric,
        "counts": result.counts,
        "bytes": result.bytes,
        "b_deltas": result.b_deltas.to_dict(),
        "columns": list(COLUMNS),
        "keys": rows,
        "layers": _layers(result),
    }


COLUMNS = (
    "key", "layer", "leaf", "status", "kind", "dtype", "shape", "bytes", "chunk_fraction",
    "changed_chunks", "total_chunks", "rel", "max_abs", "reason",
)  # fmt: skip


def _row(k: KeyDiff) -> list[Any]:
    layer, leaf = layer_of(k.key)
    shape = k.shape_b if k.shape_b is not None else k.shape_a
    max_abs = k.numeric.max_abs_diff if k.numeric is not None else None
    return [
        k.key, layer, leaf, k.status, k.kind, k.dtype_b or k.dtype_a,
        None if shape is None else list(shape),
        k.bytes_b if k.bytes_b is not None else k.bytes_a,
        k.chunk_fraction if k.status == CHANGED else None,
        k.changed_chunks, k.total_chunks,
        _json(relative_change(k)), _json(max_abs), k.reason,
    ]  # fmt: skip


def _worse(rel: float, than: float) -> bool:
    """Whether change ``rel`` outranks ``than``: NaN over infinity over any finite change."""
    if math.isnan(than):
        return False
    return math.isnan(rel) or rel > than


def _json(x: float | None) -> float | str | None:
    """Strict JSON has no NaN or infinities: those become strings."""
    return x if x is None or math.isfinite(x) else str(x)


def _layers(result: DiffResult) -> list[dict[str, Any]]:
    """Per layer: its keys' positions, the strongest status, the largest change."""
    layers: dict[str, dict[str, Any]] = {}
    for i, k in enumerate(result.keys):
        name, _ = layer_of(k.key)
        entry = layers.setdefault(
            name, {"layer": name, "keys": [], "status": "unchanged", "rel": None, "fraction": None}
        )
        entry["keys"].append(i)
        if STATUS_RANK[k.status] > STATUS_RANK[entry["status"]]:
            entry["status"] = k.status
        rel = relative_change(k)
        if rel is not None and (entry["rel"] is None or _worse(rel, entry["rel"])):
            entry["rel"] = rel
        if k.status == CHANGED and k.chunk_fraction is not None:
            entry["fraction"] = max(entry["fraction"] or 0.0, k.chunk_fraction)
    for entry in layers.values():
        entry["rel"] = _json(entry["rel"])
    return list(layers.values())
