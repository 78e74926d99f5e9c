"""Index queries for compaction: which chunks are loose, and the one-transaction switch of
rewritten chunks to their dense pack.

A take writes its new chunks into *loose* packs (``packs.loose``): the fast codec, no deltas.
Compaction reads the loose chunks that no newest snapshot of a run uses, writes them densely
into new packs, and switches their rows to the new packs with :meth:`Compaction.rewrite_chunks`
(compare-and-swap on the old pack, so a chunk gc pruned or moved meanwhile is left alone). The
old packs are then retired like any pack gc emptied.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from ckstore.index import _convert, _sql
from ckstore.index._batches import batches
from ckstore.index._sql import check_lease
from ckstore.index.base import IndexBase
from ckstore.index.records import ChunkRecord, PackRecord
from ckstore.index.tiering import MAX_DEPTH


class Compaction(IndexBase):
    """Compaction: the loose chunks, and their switch to dense packs."""

    def loose_chunks(self) -> list[ChunkRecord]:
        """Every chunk row that lives in a loose pack (one a take wrote with its fast codec,
        not retired), in pack and offset order."""
        c, p = _sql.chunks, _sql.packs
        query = (
            select(c)
            .join(p, p.c.id == c.c.pack_id)
            .where(p.c.loose.is_(True) & p.c.retired_at.is_(None))
            .order_by(c.c.pack_id, c.c.offset)
        )
        with self._read("list loose chunks") as conn:
            return [_convert.chunk(r) for r in conn.execute(query)]

    def loose_bytes(self) -> int:
        """Stored bytes of the chunks in loose packs (what compaction may rewrite)."""
        c, p = _sql.chunks, _sql.packs
        query = (
            select(c.c.length)
            .join(p, p.c.id == c.c.pack_id)
            .where(p.c.loose.is_(True) & p.c.retired_at.is_(None))
        )
        with self._read("measure loose chunks") as conn:
            return sum(int(n) for n in conn.scalars(query))

    def referencing_snapshots(self, chunk_ids: Iterable[str]) -> set[str]:
        """Ids of the snapshots that reference any of ``chunk_ids``."""
        sc = _sql.snapshot_chunks
        found: set[str] = set()
        with self._read("find snapshots of chunks") as conn:
            for batch in batches(list(dict.fromkeys(chunk_ids))):
                found.update(
                    conn.scalars(
                        select(sc.c.snapshot_id).where(sc.c.chunk_id.in_(batch)).distinct()
                    )
                )
        return found

    def rewrite_chunks(
        self, session_id: str, pack: PackRecord, moves: Sequence[tuple[ChunkRecord, str]]
    ) -> list[str]:
        """Record a durable dense ``pack`` and switch each chunk of ``moves`` (its new row, and
        the pack it was read from) to it, in one transaction; return the ids switched.

        A row is switched only if it still lives in the pack it was read from (gc may have
        pruned or moved it meanwhile): a compare-and-swap per row. The new row may change the
        codec, the delta base, the chain depth and the payload digest; the chunk's id, and so
        everything that references it, stays the same. A delta's base must be a chunk the
        index holds (the caller pins it to ``session_id`` first, so gc cannot prune it); its
        depth is the base's as stored now plus one. A chunk is left as it is when it would
        become a delta while some delta is stored against it (its dependents' chains would
        grow; and a chain that led back to it would become a cycle: another compaction,
        concurrent, may have planned the other way round), when another write session pins it
        (a take may be writing a delta against it, with the depth it read: its chain would
        outgrow the store's ``delta_depth``), or when its base's chain would grow past
        :data:`MAX_DEPTH`. ``moves`` are switched in order: bases first.

        Raises:
            LeaseExpiredError: the compaction's session expired (gc may have taken its pins).
        """
        c, p = _sql.chunks, _sql.packs
        done: list[str] = []
        with self._write(f"rewrite chunks into pack {pack.pack_id}") as conn:
            now = check_lease(conn, session_id, lock=True)
            _lock_rows(conn, [m.chunk_id for m, _ in moves] + [m.base_id for m, _ in moves])
            _sql.insert_ignore(
                conn,
                p,
                [
                    {
                        "id": pack.pack_id,
                        "size": pack.size,
                        "chunk_count": pack.chunk_count,
                        "created_at": pack.created_at or now,
                        "loose": pack.loose,
                    }
                ],
            )
            for new, old_pack in moves:
                depth = 0 if new.base_id is None else _delta_depth(conn, new, session_id)
                if depth is None:
                    continue
                switched = conn.execute(
                    update(c)
                    .where((c.c.id == new.chunk_id) & (c.c.pack_id == old_pack))
                    .values(
                        pack_id=pack.pack_id,
                        offset=new.offset,
                        length=new.length,
                        raw_length=new.raw_length,
                        codec=new.codec,
                        base_id=new.base_id,
                        depth=depth,
                        payload_digest=new.payload_digest,
                    )
                ).rowcount
                if switched:
                    done.append(new.chunk_id)
        return done

    def dependents_of(self, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` that some delta is stored against (they must stay whole)."""
        c = _sql.chunks
        found: set[str] = set()
        with self._read("find delta bases") as conn:
            for batch in batches(list(dict.fromkeys(chunk_ids))):
                found.update(
                    conn.scalars(select(c.c.base_id).where(c.c.base_id.in_(batch)).distinct())
                )
        return found


def _lock_rows(conn: Connection, chunk_ids: Iterable[str | None]) -> None:
    """Lock the rows of these chunks, in id order (two compactions lock alike: no deadlock)."""
    c = _sql.chunks
    ids = sorted({i for i in chunk_ids if i is not None})
    for batch in batches(ids):
        conn.execute(select(c.c.id).where(c.c.id.in_(batch)).order_by(c.c.id).with_for_update())


def _delta_depth(conn: Connection, new: ChunkRecord, session_id: str) -> int | None:
    """The depth a delta row gets now (its base's plus one); None if it must stay as it is."""
    c, pins = _sql.chunks, _sql.pins
    if new.base_id == new.chunk_id:
        return None
    if conn.scalar(select(c.c.id).where(c.c.base_id == new.chunk_id).limit(1)) is not None:
        return None  # a delta is stored against it
    live = select(_sql.sessions.c.id).where(  # a crashed take's pins count no more
        (_sql.sessions.c.state == _sql.ACTIVE) & (_sql.sessions.c.expires_at >= time.time())
    )
    pinned = select(pins.c.chunk_id).where(
        (pins.c.chunk_id == new.chunk_id)
        & (pins.c.session_id != session_id)
        & pins.c.session_id.in_(live)
    )
    if conn.scalar(pinned.limit(1)) is not None:
        return None  # a take may be writing a delta against it, at the depth it read
    base = conn.scalar(select(c.c.depth).where(c.c.id == new.base_id))
    if base is None or int(base) + 1 > MAX_DEPTH:
        return None
    return int(base) + 1
