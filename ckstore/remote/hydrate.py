"""Bring evicted chunks back to the local tier: the inverse of :mod:`.evict`.

For each pack of a remote that rows of this store point at (chunks the local budget evicted):

1. Read the span of its live chunks there in one ranged read (through :class:`.tier.TierBackend`).
2. Verify each payload (decoded, a delta XORed onto its verified base, and hashed against its
   id: the digests in those rows came from the remote, :mod:`ckstore.objects.received`), then
   write them, as they are stored (same codec,
   a delta against the same base), into a new local pack, made durable.
3. One index transaction records the new pack and points the rows at it, each a
   compare-and-swap on the remote pack (a chunk pruned or moved meanwhile is left alone).
4. The remote pack's row, now empty, is retired and dropped; nothing is deleted at the remote.

Killed after 2, the new local pack is an orphan gc removes; killed after 3, the remote pack's
row is an empty row the next gc drops. Open the store without ``local_budget`` first, or the
next eviction pass sends the chunks away again.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine.lease import Lease
from ..engine.locations import to_location, to_records
from ..errors import CorruptionError, ReadOnlyStoreError
from ..index import ChunkRecord, PackRecord
from ..objects.received import matches_id

if TYPE_CHECKING:
    from ..engine.interfaces import TierIndex
    from ..engine.repository import Repository


@dataclass
class HydrateReport:
    """What :func:`hydrate` brought back."""

    packs: int = 0
    chunks: int = 0
    bytes: int = 0
    """Stored bytes written to the local tier."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hydrate(local: Repository, remote: str | None = None) -> HydrateReport:
    """Bring every chunk evicted to ``remote`` (None: to any remote) back to the local tier
    (module docstring).

    Raises:
        ReadOnlyStoreError: ``local`` is read-only (refused before anything is written).
        CorruptionError: a payload read at the remote is damaged (named, with the remote); the
            chunks of that pack stay evicted, those brought back before stay local.
        StorageError: the remote cannot be read.
    """
    index: TierIndex = local.index
    if local.read_only:
        raise ReadOnlyStoreError(
            f"cannot hydrate {local.url}: {index.read_only}; hydrating writes packs here"
        )
    report = HydrateReport()
    packs = sorted(p for p, r in index.remote_pack_ids().items() if remote is None or r == remote)
    # the packs written here are a writer's until recorded: a gc beside sees a session alive
    # and takes none of them for an orphan
    with Lease(index, local.lease_seconds) as lease:
        for pack_id in packs:
            rows = index.chunks_in_packs([pack_id])
            if rows:
                report.chunks += _bring_back(local, lease, pack_id, rows)
                report.bytes += sum(r.length for r in rows)
                report.packs += 1
        index.end_session(lease.id, "committed")  # nothing to commit: its packs are recorded
        lease.committed = True
    retired = index.retire_packs(packs)
    index.delete_retired_packs(time.time(), only=retired)  # rows only: the packs are the remote's
    return report


def _bring_back(local: Repository, lease: Lease, pack_id: str, rows: list[ChunkRecord]) -> int:
    index: TierIndex = local.index
    name = objects.pack_name(pack_id)
    start = min(r.offset for r in rows)
    span = memoryview(
        local.objects.backend.get(name, start, max(r.offset + r.length for r in rows) - start)
    )
    bases = index.chunk_locations(
        r.chunk_id for r in rows if r.base_id is not None
    )  # with their chains
    writer = local.objects.new_pack_writer(local.config.pack_bytes * 4)
    try:
        for r in rows:
            payload = span[r.offset - start : r.offset - start + r.length]
            _verify(local, r, payload, bases, pack_id)
            writer.add(r.chunk_id, r.codec, payload, r.raw_length, r.base_id)
    except BaseException:
        writer.abort()
        raise
    done = writer.finish()  # durable first...
    assert done is not None
    new_id, size, locs = done
    moves = to_records(locs)
    if lease.error is not None:  # expired: a gc may have deleted the new pack as an orphan
        raise lease.error
    return index.relocate_chunks(
        PackRecord(new_id, size, len(moves), time.time()), moves, pack_id, lease.id
    )  # ...then rows


def _verify(
    local: Repository,
    r: ChunkRecord,
    payload: memoryview,
    bases: dict[str, ChunkRecord],
    pack_id: str,
) -> None:
    """Decode the payload (a delta onto this store's verified copy of its base) and hash it
    against its id: the row's digest came from the remote, and proves nothing."""
    base = None
    if r.base_id is not None:
        base = local.objects.read_chunk(to_location(r, bases).chain()[1])
    if not matches_id(r.chunk_id, r.codec, payload, r.raw_length, base):
        raise CorruptionError(
            f"chunk {r.chunk_id} in pack {pack_id} of the remote this store evicted it to is damaged there "
            "(it does not decode to the bytes of its id; run `ckstore check --read-data` on the remote); "
            "it stays evicted"
        )
