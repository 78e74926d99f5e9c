"""The one translation between the two layers' views of a chunk's place.

``objects.ChunkLocation`` (what a pack says) and ``index.ChunkRecord`` (what the index says)
carry the same fields; the layers never import each other, so the layers above convert here.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..index import ChunkRecord
from ..objects import ChunkLocation


def to_location(rec: ChunkRecord) -> ChunkLocation:
    """The object layer's location of an indexed chunk."""
    return ChunkLocation(rec.chunk_id, rec.pack_id, rec.offset, rec.length, rec.raw_length, rec.codec)


def to_records(locs: Iterable[ChunkLocation]) -> list[ChunkRecord]:
    """Index records for the chunks a pack writer or pack trailer reports."""
    return [ChunkRecord(l.chunk_id, l.pack_id, l.offset, l.length, l.raw_length, l.codec) for l in locs]
