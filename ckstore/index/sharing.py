"""Index queries about what snapshots share, for views of a store.

Every query here is read-only and bounded by what the caller names, never by the size of the
store: a store of 10,000 snapshots that all reference one frozen backbone must not make a
"what does this snapshot share" question scan 10,000 x 1,000 references.

- :meth:`Sharing.shared_with`: chunks (and their stored bytes) one snapshot has in common
  with each of a list of others, by primary-key lookups of those pairs.
- :meth:`Sharing.exclusive_usage`: chunks no other snapshot references (what deleting it
  alone would let ``gc`` reclaim, delta bases aside).
- :meth:`Sharing.fork_sources`: for the first snapshots of runs, the earlier snapshots of
  other runs holding a sample of their chunks or of their chunks' delta bases (a fine-tune
  forked from a base model shares its unchanged tensors, or stores deltas against them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import and_, exists, func, select
from sqlalchemy.engine import Connection

from ckstore.errors import InvalidInputError
from ckstore.index import _sql
from ckstore.index._batches import batches, unique
from ckstore.index.base import IndexBase

MAX_SAMPLE = 1024
"""Most chunks :meth:`Sharing.fork_sources` samples per snapshot."""


@dataclass(frozen=True)
class Shared:
    """Chunks two snapshots both reference.

    Attributes:
        snapshot_id: The other snapshot.
        chunks: How many chunks both reference.
        stored_bytes: Their stored (compressed) length.
    """

    snapshot_id: str
    chunks: int
    stored_bytes: int


class Sharing(IndexBase):
    """What snapshots share, for views of a store."""

    def shared_with(self, snapshot_id: str, others: Sequence[str]) -> list[Shared]:
        """Chunks ``snapshot_id`` has in common with each of ``others`` (unknown ids: none).

        Returns one :class:`Shared` per other snapshot that shares at least one chunk, most
        chunks first. Cost: the chunks of ``snapshot_id`` times ``len(others)`` index lookups.
        """
        sc, c = _sql.snapshot_chunks, _sql.chunks
        mine = sc.alias("mine")
        theirs = sc.alias("theirs")
        out: list[Shared] = []
        with self._read(f"share of {snapshot_id}") as conn:
            for batch in batches([o for o in unique(others) if o != snapshot_id]):
                query = (
                    select(
                        theirs.c.snapshot_id, func.count(), func.coalesce(func.sum(c.c.length), 0)
                    )
                    .select_from(
                        mine.join(theirs, theirs.c.chunk_id == mine.c.chunk_id).join(
                            c, c.c.id == mine.c.chunk_id
                        )
                    )
                    .where((mine.c.snapshot_id == snapshot_id) & theirs.c.snapshot_id.in_(batch))
                    .group_by(theirs.c.snapshot_id)
                )
                out.extend(Shared(str(r[0]), int(r[1]), int(r[2])) for r in conn.execute(query))
        return sorted(out, key=lambda s: (-s.chunks, -s.stored_bytes, s.snapshot_id))

    def exclusive_usage(self, snapshot_id: str) -> tuple[int, int]:
        """``(chunks, stored bytes)`` of the chunks only ``snapshot_id`` references.

        The check per chunk stops at the first other reference, so a chunk every snapshot
        shares costs one lookup.
        """
        sc, c = _sql.snapshot_chunks, _sql.chunks
        other = sc.alias("other")
        alone = ~exists(
            select(other.c.chunk_id).where(
                and_(other.c.chunk_id == sc.c.chunk_id, other.c.snapshot_id != snapshot_id)
            )
        )
        query = (
            select(func.count(), func.coalesce(func.sum(c.c.length), 0))
            .select_from(sc.join(c, c.c.id == sc.c.chunk_id))
            .where((sc.c.snapshot_id == snapshot_id) & alone)
        )
        with self._read(f"exclusive chunks of {snapshot_id}") as conn:
            n, size = conn.execute(query).one()
        return int(n), int(size)

    def fork_sources(
        self, snapshot_ids: Sequence[str], sample: int = 32
    ) -> dict[str, list[Shared]]:
        """For each snapshot, earlier snapshots of other runs that hold its sampled chunks.

        The sample is the ``sample`` smallest chunk ids of the snapshot (ids are hashes, so
        this is a fixed pseudo-random sample) plus the delta bases of those chunks. A holder
        counts when it belongs to another run and was created no later than the snapshot.

        Returns:
            snapshot id -> holders, most sampled chunks held first (``Shared.stored_bytes`` is
            0: only counts are computed). Snapshots with no holder map to an empty list.

        Raises:
            InvalidInputError: ``sample`` is not an int from 1 to ``MAX_SAMPLE``.
        """
        if type(sample) is not int or not 1 <= sample <= MAX_SAMPLE:
            raise InvalidInputError(f"sample must be an int from 1 to {MAX_SAMPLE}, got {sample!r}")
        out: dict[str, list[Shared]] = {}
        with self._read("find fork sources") as conn:
            for sid in unique(snapshot_ids):
                out[sid] = _holders(conn, sid, sample)
        return out


def _holders(conn: Connection, snapshot_id: str, sample: int) -> list[Shared]:
    s, sc, c = _sql.snapshots, _sql.snapshot_chunks, _sql.chunks
    me = conn.execute(select(s.c.run, s.c.created_at).where(s.c.id == snapshot_id)).first()
    if me is None:
        return []
    ids = list(
        conn.scalars(
            select(sc.c.chunk_id)
            .where(sc.c.snapshot_id == snapshot_id)
            .order_by(sc.c.chunk_id)
            .limit(sample)
        )
    )
    if not ids:
        return []
    bases = conn.scalars(select(c.c.base_id).where(c.c.id.in_(ids) & c.c.base_id.is_not(None)))
    wanted = unique([*ids, *bases])
    query = (
        select(sc.c.snapshot_id, func.count(func.distinct(sc.c.chunk_id)))
        .select_from(sc.join(s, s.c.id == sc.c.snapshot_id))
        .where(sc.c.chunk_id.in_(wanted) & (s.c.run != me.run) & (s.c.created_at <= me.created_at))
        .group_by(sc.c.snapshot_id)
    )
    found = [Shared(str(r[0]), int(r[1]), 0) for r in conn.execute(query)]
    return sorted(found, key=lambda x: (-x.chunks, x.snapshot_id))
