"""Compare live state with a snapshot, without reading the snapshot's data.

Each live tensor is cut on the snapshot's chunk grid (the boxes its manifest lists) and each
box's raw bytes hashed: equal ids mean equal bytes, as chunk ids are BLAKE3 of the raw bytes
(docs/FORMAT.md, section 2). Inline tensors and plain values are compared with what the
manifest holds. Nothing is read from the store: the check costs one hashing pass over the live
tensors (BLAKE3, about 3.6 GB/s per thread, on the repository's threads).

What it answers: is the state in memory the state this snapshot recorded? After a restore
(``restore(verify=True)``) it checks the bytes that landed in the caller's tensors; before a
take it tells whether anything changed since.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import objects
from ...format.manifest import (
    Entry,
    Manifest,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    canonical_json,
)
from ...format.tensors import byte_view
from ...format.tree import flatten, is_array
from ...format.values import encode_value
from ..take.plan import state_dicts
from .dcp_keys import dcp_overlay, is_dcp_manifest


@dataclass
class LiveCheck:
    """What :func:`verify_live` found.

    Attributes:
        checked: keys compared.
        differs: keys whose live value differs (another dtype, shape or any byte).
        missing: keys of the snapshot (under the app_state's names) with no live value.
        extra: live keys the snapshot does not have.
        skipped: keys not compared: DTensors (each rank holds a shard; restore checks them).
    """

    checked: int = 0
    differs: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every key compared is the same and none is missing or extra."""
        return not (self.differs or self.missing or self.extra)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "differs": self.differs,
            "missing": self.missing,
            "extra": self.extra,
            "skipped": self.skipped,
        }


def verify_live(
    manifest: Manifest, app_state: dict[str, Any], *, rank: int = 0, threads: int = 4
) -> LiveCheck:
    """Compare ``app_state`` (names -> statefuls) with ``manifest``; see the module docstring.

    ``rank`` picks the element of per-rank entries (a distributed take's per-rank values).
    """
    if is_dcp_manifest(manifest):
        manifest = dcp_overlay(manifest, app_state, strict=False)
    live: dict[str, Any] = {}
    for name, sd in state_dicts(app_state).items():
        live.update(flatten(name, sd).leaves)
    wanted = {k for k in manifest.entries if k.split("/", 1)[0] in app_state}
    out = LiveCheck(missing=sorted(wanted - set(live)), extra=sorted(set(live) - wanted))
    keys = sorted(wanted & set(live))
    with ThreadPoolExecutor(
        max_workers=max(1, threads), thread_name_prefix="ckstore-verify"
    ) as pool:
        verdicts = list(pool.map(lambda k: _same(manifest.entries[k], live[k], rank), keys))
    for key, same in zip(keys, verdicts):
        if same is None:
            out.skipped.append(key)
            continue
        out.checked += 1
        if not same:
            out.differs.append(key)
    return out


def _same(entry: Entry, value: Any, rank: int) -> bool | None:
    if isinstance(entry, PerRankEntry):
        if rank >= len(entry.entries):
            return False
        entry = entry.entries[rank]
    if isinstance(entry, ValueEntry):
        if is_array(value):
            return False
        try:
            return canonical_json(encode_value(value, "live")) == canonical_json(entry.encoded)
        except (TypeError, ValueError):
            return False
    if not is_array(value):
        return False
    if isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor":
        return None
    t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    return _same_tensor(entry, t)


def _same_tensor(entry: TensorEntry, t: torch.Tensor) -> bool:
    from ...format.dtypes import dtype_name

    if tuple(t.shape) != tuple(entry.shape) or dtype_name(t.dtype, "live") != entry.dtype:
        return False
    if entry.data is not None:
        return bytes(byte_view(t)) == entry.data
    for ref in entry.chunks:
        box = t[tuple(slice(o, o + n) for o, n in zip(ref.offsets, ref.sizes))]
        if objects.chunk_id(byte_view(box)) != ref.id:
            return False
    return True
