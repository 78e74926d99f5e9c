"""Chunks whose verified bytes come from elsewhere than the fetcher's own read of this store.

A :class:`~.fetch.Fetcher` reads and checks each chunk itself, except where one of these hands
it bytes already verified: a :class:`ChunkSource` (what a distributed restore received from
the rank that read and verified them), and a :data:`Healer` (what a heal brought back from a
remote for a chunk found damaged here, verified against its id).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class ChunkSource(Protocol):
    """Chunks whose decoded bytes are already in memory and verified, by id (what a
    distributed restore received from the rank that read and verified them)."""

    def get(self, cid: str) -> memoryview | None:
        """The chunk's ``raw_length`` decoded bytes, or None when this source lacks it."""
        ...


Healed = bool | memoryview
"""What a :data:`Healer` brought back (see there)."""

Healer = Callable[[str], Healed]
"""Given the id of a chunk that failed its check or whose pack is gone, brings back a sound copy
of it from elsewhere: either its decoded bytes (``raw_length`` of them, verified against the id
by the healer, which writes them back into this store behind the read), which the fetcher uses
at once and does not read again; or True when it wrote a sound copy of the chunk (and of any
damaged base of its delta chain) into this store and pointed the index at it (the chunk is then
read again at its new place); or False when it could not. Called from the fetcher's threads
at once: it is thread-safe."""
