"""The local budget of a two-tier store: evict pushed chunks, least recently used packs first.

A local pack may go when every chunk in it is referenced by a snapshot the remote holds (pushed
there and recorded): then the remote keeps each of them for as long as it keeps that snapshot.
Its index's word is not enough (docs/RELIABILITY.md, I7): an index can outlive its packs (a
bucket emptied under it), and a remote PostgreSQL can lose commits it acknowledged (an
asynchronous replica promoted). So a pass first shows that:

- the remote is still the store it was (its ``ckstore.json``, read again: :func:`.config.confirm`);
- every snapshot this store records as held there is in the remote's index (one it lost is
  forgotten here, so it is ``pushing`` again and the uploader sends it again);

and before each local pack goes (the last local copy of its chunks), that every pack of the
remote its chunks would point at exists with the size the remote recorded (one stat or HEAD per
pack), and that a sample of its chunks read there decode to their ids (:class:`Proof`). A pack
not shown stays.

For each pack that may go, least recently used first (the last read through
:class:`.tier.TierBackend`, else when it was written), until the local packs fit the budget:

1. Look its chunks up in the remote's index (where the remote holds each: its pack, codec,
   base), and show the remote holds them (above).
2. One local index transaction points their rows there (``Index.point_chunks_at_remote``: a
   compare-and-swap on the local pack; a chunk a live writer pins stays, chain depths follow).
3. Once no row is left in the pack, retire its row and delete it, then delete the object.

A pack kept while later ones went is tried again in the same pass (until a round moves
nothing): a chunk the switch leaves local because the remote stores it as a delta against a
chunk stored here as a delta against it (the pair encoded the other way round) may go once that
base has.

Killed after 2, the pack object is an orphan gc removes; before, nothing changed. A reader that
located a chunk in the pack just before finds it gone, looks the chunk up again and reads it at
the remote (verified as always). Nothing is deleted at the remote, ever.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .config import confirm
from .holdings import lost_by
from .proof import Proof
from .tier import ordered

if TYPE_CHECKING:
    from ..engine.interfaces import ProofIndex, TierIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")


@dataclass
class EvictReport:
    """What one eviction pass did."""

    budget: int
    local_bytes_before: int = 0
    local_bytes_after: int = 0
    packs_evicted: int = 0
    chunks_evicted: int = 0
    packs_kept: int = 0
    """Packs over the budget that could not go (a chunk not held by the remote, or pinned), in
    the pass's last round (a pass goes over the packs it kept again while others went)."""

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

    Raises:
        NotFoundError, ConflictError: the remote is no longer the store it was (nothing evicted).
    """
    index: TierIndex = local.index
    local.write_backs.wait()  # healed chunks land before packs are judged held elsewhere
    if used:
        index.touch_packs(used)
    packs = index.local_packs_by_use()
    report = EvictReport(budget, local_bytes_before=sum(size for _, size, _ in packs))
    total = report.local_bytes_before
    remote_packs: dict[str, str] = {}
    if total <= budget:
        report.local_bytes_after = total
        return report, remote_packs
    confirm(remote, name)
    lost_by(local, remote, name)  # forgotten here: pushed again, nothing evicted for them
    proof = Proof(remote)
    todo = [(pack_id, size) for pack_id, size, _ in packs]
    kept: list[tuple[str, int]] = []
    while todo:  # again over those kept while others went: a chunk kept because its remote
        kept = []  # base is a delta against it here may go once that base has gone
        for pack_id, size in todo:
            if total <= budget:
                break
            moved = _evict_pack(local, remote, name, pack_id, remote_packs, proof)
            if moved is None:
                kept.append((pack_id, size))
                continue
            report.chunks_evicted += moved
            report.packs_evicted += 1
            total -= size
        if total <= budget or len(kept) == len(todo):
            break
        todo = kept
    report.packs_kept = len(kept)
    report.local_bytes_after = total
    return report, remote_packs


def _evict_pack(
    local: Repository,
    remote: Repository,
    name: str,
    pack_id: str,
    remote_packs: dict[str, str],
    proof: Proof,
) -> int | None:
    """Evict one pack; the chunks switched, or None if it stays (wholly or in part)."""
    index: TierIndex = local.index
    rows = index.chunks_in_packs([pack_id])
    ids = [r.chunk_id for r in rows]
    if not ids or index.pushed_chunk_ids(name, ids) != set(ids):
        return None
    theirs: ProofIndex = remote.index
    found = theirs.chunk_locations(ids)
    if any(i not in found for i in ids) or not proof.holds(found, ids):
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
