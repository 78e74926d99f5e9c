"""The local tier's rows (revision 0006): when reads last used each pack, and the chunks the
tier evicted to a remote.

A two-tier store (``ckstore.open(..., push_to=...)``) keeps its packs under a local budget:
the least recently used go once their chunks are safe at the tier remote. A chunk *evicted*
from the local tier keeps its row, pointed at the remote's own place for it: a pack row marked
``remote`` (a pack of that remote), so a read goes there (with no payload digest: the
remote's proves nothing). Its delta base (the remote's, which
the store may not have had) gets a row too. :meth:`Tiering.point_chunks_at_remote` switches
rows in one transaction, keeping the chain depths exact (a chunk's depth is its base's plus
one, dependents follow) and leaving alone any chunk a live write session relies on. Which
snapshots a remote holds is in ``remote``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from ckstore.index import _convert, _sql
from ckstore.index._batches import batches, unique
from ckstore.index._sql import insert_ignore
from ckstore.index.base import IndexBase
from ckstore.index.records import ChunkRecord

MAX_DEPTH = 64
"""Deepest chain a switch may build (readers refuse longer ones, ``objects.delta.MAX_CHAIN``)."""


class Tiering(IndexBase):
    """Pack use, and chunk rows pointed at a remote."""

    def remote_pack_ids(self) -> dict[str, str]:
        """Pack id -> remote, for every pack row of a remote (what evicted chunks point at)."""
        p = _sql.packs
        with self._read("list remote packs") as conn:
            return {
                str(i): str(r)
                for i, r in conn.execute(select(p.c.id, p.c.remote).where(p.c.remote.is_not(None)))
            }

    def local_packs_by_use(self) -> list[tuple[str, int, float]]:
        """Local, live packs as ``(id, size, last used)``, least recently used first (``used_at``,
        else when the pack was written)."""
        p = _sql.packs
        used = func.coalesce(p.c.used_at, p.c.created_at)
        query = (
            select(p.c.id, p.c.size, used)
            .where(p.c.remote.is_(None) & p.c.retired_at.is_(None))
            .order_by(used, p.c.id)
        )
        with self._read("list local packs") as conn:
            return [(str(i), int(n), float(t)) for i, n, t in conn.execute(query)]

    def touch_packs(self, used: Mapping[str, float]) -> None:
        """Record when reads last used these packs (only ever later)."""
        p = _sql.packs
        with self._write("record pack use") as conn:
            for pack_id, t in used.items():
                conn.execute(
                    update(p)
                    .where((p.c.id == pack_id) & ((p.c.used_at.is_(None)) | (p.c.used_at < t)))
                    .values(used_at=t)
                )

    def chunks_in_packs(self, pack_ids: Iterable[str]) -> list[ChunkRecord]:
        """The chunk rows that live in these packs."""
        c = _sql.chunks
        with self._read("list chunks of packs") as conn:
            return [
                _convert.chunk(r)
                for b in batches(unique(pack_ids))
                for r in conn.execute(select(c).where(c.c.pack_id.in_(b)))
            ]

    def point_chunks_at_remote(
        self, remote: str, records: Sequence[ChunkRecord], expected: Mapping[str, str]
    ) -> list[str]:
        """Point chunk rows at the remote's places for them, in one transaction; return the ids
        switched.

        ``records`` are the remote's rows (its packs, offsets, codecs, bases; their ``depth``
        and payload digests are ignored), bases before the deltas stored against them. The
        rows switched get no payload digest: one the remote supplies proves nothing, so every
        read of them decodes and hashes against the chunk's id. Each pack they name
        gets a row marked ``remote``. A chunk in ``expected`` (id -> the pack its row must still
        be in: a compare-and-swap) is switched; a chunk the store has no row for is added (a base
        only the remote had). Depths are recomputed here: a chunk's is its base's (as stored
        after this transaction) plus one, and every delta stored against a switched chunk moves
        by as much. A chunk is left alone if a live write session pins it or any of those
        dependents (a take may be writing a delta against it with the depth it read), if the
        chain would grow past :data:`MAX_DEPTH`, if its base has no row, or if its base is
        stored here as a delta against it (the remote encodes the pair the other way round:
        switching would make a cycle neither could be read from). Nothing is switched if the
        remote is no longer one of the store's (removed while the caller proved its packs).
        """
        c, p = _sql.chunks, _sql.packs
        done: list[str] = []
        with self._write(f"point chunks at remote {remote!r}") as conn:
            _sql.gc_barrier(conn)
            if not _remote_kept(conn, remote):
                return done  # removed meanwhile: nothing may come to live only there
            now = time.time()
            packs = unique(r.pack_id for r in records)
            insert_ignore(
                conn,
                p,
                [
                    {
                        "id": pid,
                        "size": 0,
                        "chunk_count": 0,
                        "created_at": now,
                        "loose": False,
                        "remote": remote,
                    }
                    for pid in packs
                ],
            )
            for rec in records:
                depth = _depth_of_base(conn, rec)
                if depth is None:
                    continue
                old = conn.execute(
                    select(c).where(c.c.id == rec.chunk_id).with_for_update()
                ).first()
                if old is None:
                    if rec.chunk_id in expected:
                        continue  # pruned meanwhile
                    row = _convert.chunk_row(_with(rec, depth), now)
                    insert_ignore(conn, c, [row])
                    continue
                if expected.get(rec.chunk_id) != old.pack_id:
                    continue  # moved meanwhile (or a base the store holds already: kept as it is)
                if _switch(conn, rec, depth, int(old.depth)):
                    done.append(rec.chunk_id)
        return done


def _depth_of_base(conn: Connection, rec: ChunkRecord) -> int | None:
    """The depth ``rec`` gets here: 0 whole, else its base's plus one (None: no base row)."""
    if rec.base_id is None:
        return 0
    base = conn.scalar(select(_sql.chunks.c.depth).where(_sql.chunks.c.id == rec.base_id))
    return None if base is None else int(base) + 1


def _remote_kept(conn: Connection, remote: str) -> bool:
    """Whether ``remote`` is still one of the store's, its row locked against a concurrent
    ``remove_remote`` until this transaction ends (a share lock: pushes recording snapshots
    there go on)."""
    r = _sql.remotes
    found = select(r.c.name).where(r.c.name == remote).with_for_update(read=True)
    return conn.execute(found).first() is not None


def _leads_back(conn: Connection, base_id: str | None, chunk_id: str) -> bool:
    """Whether the chain from ``base_id`` down to a whole chunk, as stored, passes ``chunk_id``
    (or does not end: a cycle already there). Each row walked is share-locked until the
    transaction ends: a compaction beside cannot re-encode one of them (making it a delta of
    something that leads back here) between this walk and the switch."""
    c = _sql.chunks
    seen: set[str] = set()
    while base_id is not None:
        if base_id == chunk_id or base_id in seen:
            return True
        seen.add(base_id)
        base_id = conn.scalar(
            select(c.c.base_id).where(c.c.id == base_id).with_for_update(read=True)
        )
    return False


def _switch(conn: Connection, rec: ChunkRecord, depth: int, old_depth: int) -> bool:
    """Switch one row (already locked) and shift its dependents' depths; False if refused."""
    c, pins = _sql.chunks, _sql.pins
    if _leads_back(conn, rec.base_id, rec.chunk_id):
        return False  # its new base is a delta against it here: this chunk stays local
    if rec.base_id is not None:  # its base's depth as locked by the walk, not as first read
        base_depth = conn.scalar(select(c.c.depth).where(c.c.id == rec.base_id))
        if base_depth is None:
            return False
        depth = int(base_depth) + 1
    tree = [rec.chunk_id]
    if depth != old_depth:  # every delta stored against it, at any distance, moves too
        todo, seen = [rec.chunk_id], {rec.chunk_id}
        while todo:
            found = [
                str(i)
                for b in batches(todo)
                for i in conn.scalars(select(c.c.id).where(c.c.base_id.in_(b)).with_for_update())
            ]
            if seen.intersection(found):
                return False  # a cycle among its dependents: never make it deeper
            seen.update(found)
            tree += found
            todo = found
        deepest = max(
            (conn.scalar(select(func.max(c.c.depth)).where(c.c.id.in_(b))) or 0)
            for b in batches(tree)
        )
        if int(deepest) + depth - old_depth > MAX_DEPTH:
            return False
    if any(
        conn.scalar(select(func.count()).select_from(pins).where(pins.c.chunk_id.in_(b)))
        for b in batches(tree)
    ):
        return False  # a live writer relies on it (or on a delta against it): next time
    conn.execute(
        update(c)
        .where(c.c.id == rec.chunk_id)
        .values(
            pack_id=rec.pack_id,
            offset=rec.offset,
            length=rec.length,
            raw_length=rec.raw_length,
            codec=rec.codec,
            base_id=rec.base_id,
            depth=depth,
            payload_digest=None,
        )
    )
    if depth != old_depth:
        for b in batches(tree[1:]):
            conn.execute(
                update(c).where(c.c.id.in_(b)).values(depth=c.c.depth + (depth - old_depth))
            )
    return True


def _with(rec: ChunkRecord, depth: int) -> ChunkRecord:
    return ChunkRecord(
        rec.chunk_id,
        rec.pack_id,
        rec.offset,
        rec.length,
        rec.raw_length,
        rec.codec,
        rec.base_id,
        depth,
        None,
    )
