"""Where a chunk lives: its pack, the byte range of its payload, its codec, and for a delta the
location of its base (so whoever holds a location holds the whole chain)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckstore.errors import CorruptionError
from ckstore.objects.delta import MAX_CHAIN


@dataclass(frozen=True)
class ChunkLocation:
    """Where one chunk lives: its pack and the byte range of its encoded payload.

    A delta (``codecs.is_delta(codec)``) names its base chunk in ``base_id``; ``base`` is the
    base's location once someone resolved it (the index knows it, a pack does not), so a
    reader holding a location holds the whole chain. ``payload_digest``
    (``hashing.payload_digest`` of the stored payload) comes from the writer or the index; a
    pack's trailer does not hold it.
    """

    chunk_id: str
    pack_id: str
    offset: int
    length: int
    raw_length: int
    codec: str
    base_id: str | None = None
    base: ChunkLocation | None = field(default=None, compare=False, repr=False)
    payload_digest: str | None = field(default=None, compare=False, repr=False)

    def digests_known(self) -> bool:
        """Whether every payload along this chunk's chain has its digest (``payload_digest``):
        a reader can then check the stored bytes without decoding them."""
        loc: ChunkLocation | None = self
        while loc is not None:
            if loc.payload_digest is None:
                return False
            loc = loc.base if loc.base_id is not None else None
        return True

    def chain(self) -> list[ChunkLocation]:
        """This location and its bases, down to the full chunk at the root.

        Raises:
            CorruptionError: a base is not resolved, has another length, or the chain is
                longer than ``delta.MAX_CHAIN`` (a cycle).
        """
        out: list[ChunkLocation] = [self]
        while out[-1].base_id is not None:
            loc = out[-1]
            if loc.base is None or loc.base.chunk_id != loc.base_id:
                raise CorruptionError(
                    f"chunk {loc.chunk_id} is a delta against chunk {loc.base_id}, which the "
                    "index does not know (or records at an inconsistent chain depth): run "
                    "`ckstore check` (the index may need `ckstore reindex`)"
                )
            if loc.base.raw_length != loc.raw_length or len(out) > MAX_CHAIN:
                raise CorruptionError(
                    f"chunk {self.chunk_id} has a broken delta chain at {loc.chunk_id} "
                    f"(base of {loc.base.raw_length} bytes for {loc.raw_length}, or over {MAX_CHAIN} links)"
                )
            out.append(loc.base)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the fields (the base by id only)."""
        d: dict[str, Any] = {
            "chunk_id": self.chunk_id,
            "pack_id": self.pack_id,
            "offset": self.offset,
            "length": self.length,
            "raw_length": self.raw_length,
            "codec": self.codec,
        }
        if self.base_id is not None:
            d["base_id"] = self.base_id
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkLocation:
        """The inverse of :meth:`to_dict`."""
        base = d.get("base_id")
        return cls(
            str(d["chunk_id"]),
            str(d["pack_id"]),
            int(d["offset"]),
            int(d["length"]),
            int(d["raw_length"]),
            str(d["codec"]),
            None if base is None else str(base),
        )
