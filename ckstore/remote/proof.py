"""A remote shown to hold chunks in fact, not on its index's word (docs/RELIABILITY.md, I7):
what an eviction checks before it lets the local copy of a pack go, and a gc before it drops
a snapshot a tier remote is recorded to hold (the remote's copy then the only one)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from ..engine.locations import to_location
from ..errors import CorruptionError, ObjectNotFoundError
from ..index import ChunkRecord

if TYPE_CHECKING:
    from ..engine.interfaces import ProofIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")

SAMPLE_CHUNKS = 2
"""Chunks of each batch read back at the remote and decoded to their ids."""


class Proof:
    """Shows that the remote holds chunks in fact, not on its index's word: each of its packs
    they lie in exists with its recorded size (one stat per pack, remembered for the pass), and
    ``sample`` chunks of each batch, read there, decode to their ids."""

    def __init__(self, remote: Repository, sample: int = SAMPLE_CHUNKS) -> None:
        self.remote, self.sample = remote, sample
        self._index: ProofIndex = remote.index
        self._sizes: dict[str, int | None] = {}
        self._rng = random.Random()

    def holds(self, found: dict[str, ChunkRecord], ids: list[str]) -> bool:
        """Whether the remote holds the chunks ``ids`` where ``found`` (its rows, with every
        base along their chains) says."""
        ends: dict[str, int] = {}
        for r in found.values():
            ends[r.pack_id] = max(ends.get(r.pack_id, 0), r.offset + r.length)
        recorded = self._index.pack_sizes([p for p in ends if p not in self._sizes])
        for pack_id, end in ends.items():
            if pack_id not in self._sizes:
                self._sizes[pack_id] = self._stat(pack_id, recorded.get(pack_id))
            size = self._sizes[pack_id]
            if size is None or size < end:
                return False
        for cid in self._rng.sample(ids, min(self.sample, len(ids))):
            try:
                self.remote.objects.read_chunk(to_location(found[cid], found))
            except (CorruptionError, ObjectNotFoundError) as exc:
                log.warning("ckstore: not shown at the remote: chunk %s: %s", cid, exc)
                return False
        return True

    def _stat(self, pack_id: str, recorded: int | None) -> int | None:
        """The pack's size at the remote; None if it is missing or not the size recorded."""
        try:
            size = self.remote.objects.pack_size(pack_id)
        except ObjectNotFoundError:
            log.warning(
                "ckstore: not relying on what lies in pack %s of the remote %s: the pack is "
                "missing there (its index still names it)",
                pack_id,
                self.remote.url,
            )
            return None
        if recorded and size != recorded:
            log.warning(
                "ckstore: not relying on what lies in pack %s of the remote %s: %d bytes there, "
                "%d recorded",
                pack_id,
                self.remote.url,
                size,
                recorded,
            )
            return None
        return size
