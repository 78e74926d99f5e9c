"""The local budget of a two-tier store: evict pushed chunks, least recently used packs first.

A local pack may go when every chunk in it is referenced by a snapshot the remote holds (pushed
there and recorded): then the remote keeps each of them for as long as it keeps that snapshot.
For each such pack, least recently used first (the last read through :class:`.tier.TierBackend`,
else when it was written), until the local packs fit the budget:

1. Look its chunks up in the remote's index (where the remote holds each: its pack, codec, base).
2. One local index transaction points their rows there (``Index.point_chunks_at_remote``: a
   compare-and-swap on the local pack; a chunk a live writer pins stays, chain depths follow).
3. Once no row is left in the pack, retire its row and delete it, then delete the object.

Killed after 2, the pack object is an orphan gc removes; before, nothing changed. A reader that
located a chunk in the pack just before finds it gone, looks the chunk up again and reads it at
the remote (verified as always). Nothing is deleted at the remote, ever.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .tier import ordered

if TYPE_CHECKING:
    from ..engine.interfaces import LocationIndex, TierIndex
    from ..engine.repository import Repository


@dataclass
class EvictReport:
    """What one eviction pass did."""

    budget: int
    local_bytes_before: int = 0
    local_bytes_after: int = 0
    packs_evicted: int = 0
    chunks_evicted: int = 0
    packs_kept: int = 0
    """Packs over the budget that could not go (a chunk not held by the remote, or pinned)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evict(
    local: Repository,
    remote: Repository,
    name: str,
    budget: int,
    used: dict[str, float] | None = None,
) -> tuple[EvictReport, dict[str, str]]:
    """Evict least recently used local packs until they fit ``budget`` bytes (module docstring).

    ``used`` (pack id -> when a read last used it) is recorded first. Returns the report and the
    remote's packs the switched rows now point at (pack id -> ``name``).
    """
    index: TierIndex = local.index
    if used:
        index.touch_packs(used)
    packs = index.local_packs_by_use()
    report = EvictReport(budget, local_bytes_before=sum(size for _, size, _ in packs))
    total = report.local_bytes_before
    remote_packs: dict[str, str] = {}
    for pack_id, size, _ in packs:
        if total <= budget:
            break
        moved = _evict_pack(local, remote, name, pack_id, remote_packs)
        if moved is None:
            report.packs_kept += 1
            continue
        report.chunks_evicted += moved
        report.packs_evicted += 1
        total -= size
    report.local_bytes_after = total
    return report, remote_packs


def _evict_pack(
    local: Repository, remote: Repository, name: str, pack_id: str, remote_packs: dict[str, str]
) -> int | None:
    """Evict one pack; the chunks switched, or None if it stays (wholly or in part)."""
    index: TierIndex = local.index
    rows = index.chunks_in_packs([pack_id])
    ids = [r.chunk_id for r in rows]
    if not ids or index.pushed_chunk_ids(name, ids) != set(ids):
        return None
    theirs: LocationIndex = remote.index
    found = theirs.chunk_locations(ids)
    if any(i not in found for i in ids):
        return None
    switched = index.point_chunks_at_remote(name, ordered(found), {i: pack_id for i in ids})
    remote_packs.update((r.pack_id, name) for r in found.values())
    if len(switched) != len(ids):
        return None
    retired = index.retire_packs([pack_id])
    for gone in index.delete_retired_packs(time.time(), only=retired):  # rows first...
        local.objects.delete_pack(gone)  # ...then the object
    return len(switched)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(value: int | str, what: str = "local_budget") -> int:
    """Bytes from an int or a size such as ``"200GiB"``, ``"512 MB"``, ``"1.5TiB"``.

    Raises:
        InvalidInputError: not a size, or negative.
    """
    import re

    from ..errors import InvalidInputError

    if isinstance(value, bool):
        raise InvalidInputError(
            f"{what} must be a size in bytes (an int, or a string such as '200GiB'), got {value!r}"
        )
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise InvalidInputError(
                f"{what} must be a size such as '200GiB' or '512MB' or a number of bytes, got {value!r}"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise InvalidInputError(f"{what} must be >= 0 bytes, got {value!r}")
    return n
