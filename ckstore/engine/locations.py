"""The one translation between the two layers' views of a chunk's place.

``objects.ChunkLocation`` (what a pack says) and ``index.ChunkRecord`` (what the index says)
carry the same fields; the layers never import each other, so the layers above convert here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from ..errors import ObjectNotFoundError
from ..index import ChunkRecord
from ..objects import ChunkLocation
from ..objects.delta import MAX_CHAIN

T = TypeVar("T")

MAX_MOVES = 8
"""Times a read follows a chunk that moved (gc repacking, compaction re-encoding, the old pack
deleted once its grace period passed) since it was looked up: once a move, as often as it
moves while the read runs."""


def to_location(rec: ChunkRecord, known: Mapping[str, ChunkRecord] | None = None) -> ChunkLocation:
    """The object layer's location of an indexed chunk.

    For a delta, ``known`` (e.g. what ``Index.chunk_locations`` returned, which holds every
    base) resolves its chain, so the location carries its bases; a base missing from it is
    left unresolved (reading the chunk then raises ``CorruptionError`` naming it).
    """
    base = None
    if rec.base_id is not None and known is not None:
        link = known.get(rec.base_id)
        if link is not None and link.chunk_id != rec.chunk_id and rec.depth <= MAX_CHAIN:
            base = to_location(link, known) if link.depth < rec.depth else None
    return ChunkLocation(
        rec.chunk_id,
        rec.pack_id,
        rec.offset,
        rec.length,
        rec.raw_length,
        rec.codec,
        rec.base_id,
        base,
        rec.payload_digest,
    )


def to_records(
    locs: Iterable[ChunkLocation], depths: Mapping[str, int] | None = None
) -> list[ChunkRecord]:
    """Index records for the chunks a pack writer or pack trailer reports.

    ``depths`` gives each delta's depth (its base's plus one); chunks not in it get 0.
    """
    depths = depths or {}
    return [
        ChunkRecord(
            l.chunk_id,
            l.pack_id,
            l.offset,
            l.length,
            l.raw_length,
            l.codec,
            l.base_id,
            depths.get(l.chunk_id, 0),
            l.payload_digest,
        )
        for l in locs
    ]


def places(loc: ChunkLocation) -> list[tuple[str, int]]:
    """Where each payload of a chunk's chain lives (pack, offset)."""
    return [(link.pack_id, link.offset) for link in loc.chain()]


def read_following(
    locate: Callable[[list[str]], Mapping[str, ChunkRecord]],
    loc: ChunkLocation,
    read: Callable[[ChunkLocation], T],
) -> T:
    """``read(loc)``; where a pack of the chunk's chain is gone, the chunk is looked up again
    (``locate``: ``Index.chunk_locations``) and read at its new place, up to
    :data:`MAX_MOVES` times. ``read`` must verify what it reads (a re-encoded chunk is read
    anew). Raises ``ObjectNotFoundError`` when the chunk is gone or did not move."""
    for _ in range(MAX_MOVES):
        try:
            return read(loc)
        except ObjectNotFoundError:
            found = locate([loc.chunk_id])
            rec = found.get(loc.chunk_id)
            if rec is None:
                raise
            new = to_location(rec, found)
            if places(new) == places(loc):
                raise
            loc = new
    return read(loc)
