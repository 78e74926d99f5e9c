"""What gc and check ask of the index: unreferenced rows and their pruning, the lifecycle of
packs (retired, deleted, rewritten), and inventories of every row to compare with the objects.

Safety rules these queries implement (reliability contract I4):

- A chunk row is deleted only if no snapshot references it, no write session pins it, and it
  is older than the caller's cutoff; the check and the delete happen in one transaction. On
  PostgreSQL that transaction holds the GC barrier (an advisory lock, see
  ``_sql.gc_barrier``) exclusively, so no lookup, pin or commit is half-done meanwhile; on
  SQLite every write transaction is ``BEGIN IMMEDIATE``, which serialises them anyway. Foreign keys from
  ``pins`` and ``snapshot_chunks`` to ``chunks`` are the backstop: the database refuses to
  delete a chunk something still points at.
- Sessions whose lease ran out are marked ``expired`` (never active again) and lose their
  pins before anything is pruned (``sessions``: gc calls ``expire_sessions`` first); an
  expired take then fails at commit.
- Pack rows go before pack objects: a pack with no live chunk is first *retired*
  (``retired_at``), and its row is deleted only once the grace period has passed.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import IndexError_
from ckstore.index import _convert, _sql
from ckstore.index._batches import batches
from ckstore.index._errors import translated
from ckstore.index.base import IndexBase
from ckstore.index.records import ChunkRecord, PackRecord, PackUsage


def _unreferenced(
    ignoring: Sequence[str] = (), bases: bool = True, sessions: Sequence[str] | None = None
) -> Any:
    """SQL condition: no snapshot (other than ``ignoring``) references, no session pins (of
    those in ``sessions`` only, if given), and (with ``bases``) no delta is stored against it."""
    c, sc, p = _sql.chunks, _sql.snapshot_chunks, _sql.pins
    ref = select(sc.c.chunk_id).where(sc.c.chunk_id == c.c.id)
    if ignoring:
        ref = ref.where(sc.c.snapshot_id.not_in(list(ignoring)))
    pin = select(p.c.chunk_id).where(p.c.chunk_id == c.c.id)
    if sessions is not None:
        pin = pin.where(p.c.session_id.in_(list(sessions)))
    cond = and_(~exists(ref), ~exists(pin))
    if bases:
        d = c.alias("dependent")
        cond = and_(cond, ~exists(select(d.c.id).where(d.c.base_id == c.c.id)))
    return cond


def _edges(conn: Connection, base_ids: Sequence[str]) -> list[tuple[str, str]]:
    """``(delta, base)`` for every delta stored against one of ``base_ids``."""
    c = _sql.chunks
    return [
        (str(r[0]), str(r[1]))
        for batch in batches(base_ids)
        for r in conn.execute(select(c.c.id, c.c.base_id).where(c.c.base_id.in_(batch)))
    ]


def _removable(rows: list[ChunkRecord], edges: Iterable[tuple[str, str]]) -> list[ChunkRecord]:
    """Of ``rows`` (chunks nothing references or pins), those whose every dependent delta is
    removable too: a base goes only with the last delta stored against it. ``edges`` are
    ``(delta, base)`` pairs whose base is among ``rows``."""
    gone = {r.chunk_id for r in rows}
    pairs = list(edges)
    changed = True
    while changed:
        changed = False
        for delta, base in pairs:
            if base in gone and delta not in gone:
                gone.discard(base)
                changed = True
    return [r for r in rows if r.chunk_id in gone]


class Maintenance(IndexBase):
    """What gc and check ask: unreferenced rows, pruning them, packs' lifecycle, inventories."""

    def snapshots_using(self, chunk_ids: Iterable[str]) -> dict[str, set[str]]:
        """Chunk id -> ids of the snapshots that reference it (chunks nothing references are
        left out)."""
        sc = _sql.snapshot_chunks
        out: dict[str, set[str]] = {}
        with self._read("find snapshots using chunks") as conn:
            for batch in batches(sorted(set(chunk_ids))):
                rows = conn.execute(
                    select(sc.c.chunk_id, sc.c.snapshot_id).where(sc.c.chunk_id.in_(batch))
                )
                for chunk_id, snapshot_id in rows:
                    out.setdefault(str(chunk_id), set()).add(str(snapshot_id))
        return out

    # ---------------------------------------------------------------------- chunks
    def unreferenced_chunks(
        self,
        cutoff: float,
        ignoring: Sequence[str] = (),
        sessions: Sequence[str] | None = None,
    ) -> list[ChunkRecord]:
        """Chunks older than ``cutoff`` that nothing references or pins (read only).

        ``ignoring`` lists snapshots to treat as already forgotten, ``sessions`` the only
        write sessions whose pins count (None: every pin), for dry runs: what a gc would
        prune once it forgot those snapshots and expired the other sessions.
        """
        c = _sql.chunks
        unref = _unreferenced(ignoring, bases=False, sessions=sessions)
        query = select(c).where((c.c.created_at < cutoff) & unref)
        with self._read("find unreferenced chunks") as conn:
            rows = [_convert.chunk(r) for r in conn.execute(query)]
            return _removable(rows, _edges(conn, [r.chunk_id for r in rows]))

    def young_unreferenced(
        self,
        cutoff: float,
        ignoring: Sequence[str] = (),
        sessions: Sequence[str] | None = None,
    ) -> tuple[int, int, float | None]:
        """Chunks nothing references or pins that are NOT older than ``cutoff`` (read only).

        What GC's grace period keeps. ``ignoring`` and ``sessions`` as in
        :meth:`unreferenced_chunks`.

        Returns:
            ``(count, stored bytes, newest created_at or None)``.
        """
        c = _sql.chunks
        query = select(
            func.count(c.c.id), func.coalesce(func.sum(c.c.length), 0), func.max(c.c.created_at)
        ).where((c.c.created_at >= cutoff) & _unreferenced(ignoring, sessions=sessions))
        with self._read("measure unreferenced chunks in the grace period") as conn:
            count, size, newest = conn.execute(query).one()
        return int(count), int(size), None if newest is None else float(newest)

    def prune_chunks(self, cutoff: float, ids: Iterable[str] | None = None) -> list[ChunkRecord]:
        """Delete unreferenced, unpinned chunk rows older than ``cutoff``; return them.

        With ``ids``, delete those of these chunks that nothing references or pins, whatever
        their age (the chunks of snapshots a purge deleted), instead.

        A base goes only once no delta is stored against it: each round deletes the chunks
        nothing depends on, which may free their bases for the next round (at most one round
        per link of the longest chain, plus one).
        """
        c = _sql.chunks
        removed: list[ChunkRecord] = []
        wanted = None if ids is None else sorted(set(ids))
        with self._write("prune chunks") as conn:
            _sql.gc_barrier(conn, exclusive=True)
            cond = (
                _unreferenced()
                if wanted is not None
                else (c.c.created_at < cutoff) & _unreferenced()
            )
            while True:
                if wanted is None:
                    rows = [_convert.chunk(r) for r in conn.execute(select(c).where(cond))]
                else:
                    rows = [
                        _convert.chunk(r)
                        for batch in batches(wanted)
                        for r in conn.execute(select(c).where(cond & c.c.id.in_(batch)))
                    ]
                for batch in batches([r.chunk_id for r in rows]):
                    conn.execute(delete(c).where(c.c.id.in_(batch) & cond))
                removed.extend(rows)
                if not rows or not any(r.base_id for r in rows):
                    return removed

    def shrink_log(self) -> None:
        """Give back the disk the database's write-ahead log holds (SQLite: checkpoint and
        truncate the ``-wal`` file, which otherwise keeps the size of the busiest moment; a
        no-op elsewhere and when a reader holds it)."""
        if self.dialect != "sqlite" or self._read_only is not None:
            return
        try:
            with self._lock, translated("checkpoint the index log", self._url), self._gate():
                raw = self._engine.raw_connection()  # outside a transaction: no BEGIN
                try:
                    cursor = raw.cursor()
                    cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    cursor.close()
                finally:
                    raw.close()
        except (IndexError_, sqlite3.Error):
            return  # another connection is busy: the next gc tries again

    def all_chunks(self) -> Iterator[ChunkRecord]:
        """Every chunk row (for check)."""
        with self._read("list chunks") as conn:
            return iter([_convert.chunk(r) for r in conn.execute(select(_sql.chunks))])

    # ----------------------------------------------------------------------- packs
    def pack_usage(self) -> list[PackUsage]:
        """Every pack row with its live chunk count and bytes."""
        p, c = _sql.packs, _sql.chunks
        query = (
            select(
                p.c.id,
                p.c.size,
                p.c.chunk_count,
                p.c.created_at,
                p.c.retired_at,
                func.count(c.c.id),
                func.coalesce(func.sum(c.c.length), 0),
                p.c.loose,
                p.c.remote,
            )
            .select_from(p.outerjoin(c, c.c.pack_id == p.c.id))
            .group_by(
                p.c.id,
                p.c.size,
                p.c.chunk_count,
                p.c.created_at,
                p.c.retired_at,
                p.c.loose,
                p.c.remote,
            )
        )
        with self._read("measure packs") as conn:
            return [
                PackUsage(
                    r[0],
                    int(r[1]),
                    int(r[2]),
                    float(r[3]),
                    r[4],
                    int(r[5]),
                    int(r[6]),
                    bool(r[7]),
                    r[8],
                )
                for r in conn.execute(query)
            ]

    def retire_packs(self, pack_ids: Iterable[str], now: float | None = None) -> list[str]:
        """Mark packs that hold no live chunk as retired; return those marked now."""
        now = time.time() if now is None else now
        p, c = _sql.packs, _sql.chunks
        done: list[str] = []
        with self._write("retire packs") as conn:
            for batch in batches(pack_ids):
                cond = (
                    p.c.id.in_(batch)
                    & p.c.retired_at.is_(None)
                    & ~exists(select(c.c.id).where(c.c.pack_id == p.c.id))
                )
                ids = list(conn.scalars(select(p.c.id).where(cond)))
                conn.execute(update(p).where(p.c.id.in_(ids)).values(retired_at=now))
                done.extend(ids)
        return done

    def delete_retired_packs(
        self, retired_before: float, only: Iterable[str] | None = None
    ) -> list[str]:
        """Delete rows of packs retired before the given time (of those in ``only``, if given);
        return their ids."""
        p, c = _sql.packs, _sql.chunks
        cond = (
            (p.c.retired_at.is_not(None))
            & (p.c.retired_at <= retired_before)
            & ~exists(select(c.c.id).where(c.c.pack_id == p.c.id))
        )
        with self._write("delete retired packs") as conn:
            if only is None:
                ids = list(conn.scalars(select(p.c.id).where(cond)))
            else:
                ids = [
                    i
                    for batch in batches(list(only))
                    for i in conn.scalars(select(p.c.id).where(cond & p.c.id.in_(batch)))
                ]
            for batch in batches(ids):
                conn.execute(delete(p).where(p.c.id.in_(batch) & cond))
        return ids

    def relocate_chunks(
        self,
        pack: PackRecord,
        moves: Sequence[ChunkRecord],
        old_pack_id: str,
        session_id: str | None = None,
    ) -> int:
        """Record a rewritten pack and point chunks from ``old_pack_id`` at it (CAS per row).

        A chunk no longer in the old pack (pruned or moved meanwhile) is left alone. Returns
        the number of chunk rows switched. ``session_id``: the write session the new pack was
        written in, checked alive in the same transaction (once it expired, another gc may
        have deleted the pack as an orphan).

        Raises:
            LeaseExpiredError: ``session_id`` is no longer alive; nothing was recorded.
        """
        p, c = _sql.packs, _sql.chunks
        switched = 0
        with self._write(f"relocate chunks of pack {old_pack_id}") as conn:
            if session_id is not None:  # locked: not expired before this commits
                _sql.check_lease(conn, session_id, lock=True)
            for batch in batches(sorted({m.chunk_id for m in moves})):  # id order, as a take's
                conn.execute(
                    select(c.c.id).where(c.c.id.in_(batch)).order_by(c.c.id).with_for_update()
                )
            _sql.insert_ignore(
                conn,
                p,
                [
                    {
                        "id": pack.pack_id,
                        "size": pack.size,
                        "chunk_count": pack.chunk_count,
                        "created_at": pack.created_at or time.time(),
                        "loose": pack.loose,
                    }
                ],
            )
            for m in moves:
                switched += (
                    conn.execute(
                        update(c)
                        .where((c.c.id == m.chunk_id) & (c.c.pack_id == old_pack_id))
                        .values(
                            pack_id=m.pack_id,
                            offset=m.offset,
                            length=m.length,
                            raw_length=m.raw_length,
                            codec=m.codec,
                            base_id=m.base_id,
                            payload_digest=m.payload_digest,
                        )
                    ).rowcount
                    or 0
                )
        return switched

    def index_pack_ids(self) -> set[str]:
        """Ids of every pack the index knows: by its ``packs`` row or by a chunk row naming it.

        A pack a chunk row names is never an orphan, even if a damaged index lost its row.
        """
        with self._read("list packs") as conn:
            rows = set(conn.scalars(select(_sql.packs.c.id)))
            return rows | set(conn.scalars(select(_sql.chunks.c.pack_id).distinct()))

    def pack_row_ids(self) -> set[str]:
        """Ids of the packs that have a ``packs`` row."""
        with self._read("list pack rows") as conn:
            return set(conn.scalars(select(_sql.packs.c.id)))

    # ------------------------------------------------------------------- manifests
    def prune_manifests(
        self, cutoff: float, dry_run: bool = False, ignoring: Sequence[str] = ()
    ) -> list[str]:
        """Delete (or list) manifest rows no snapshot uses, older than ``cutoff``.

        Holds the GC barrier exclusive (PostgreSQL): a commit naming one of these manifests
        again (a pull re-sending a snapshot deleted here) runs wholly before or after, so it
        never keeps a manifest row whose entries this deleted."""
        m, e, s = _sql.manifests, _sql.manifest_entries, _sql.snapshots
        used = select(s.c.id).where(s.c.manifest_id == m.c.id)
        if ignoring:
            used = used.where(s.c.id.not_in(list(ignoring)))
        cond = (m.c.created_at < cutoff) & ~exists(used)
        with (self._read if dry_run else self._write)("prune manifests") as conn:
            if not dry_run:
                _sql.gc_barrier(conn, exclusive=True)
            ids = list(conn.scalars(select(m.c.id).where(cond)))
            if not dry_run:
                for batch in batches(ids):
                    conn.execute(delete(e).where(e.c.manifest_id.in_(batch)))
                    conn.execute(delete(m).where(m.c.id.in_(batch) & cond))
        return ids

    def index_manifest_ids(self, among: Iterable[str] | None = None) -> set[str]:
        """Every manifest row (of ``among``, if given)."""
        m = _sql.manifests
        with self._read("list manifests") as conn:
            if among is None:
                return set(conn.scalars(select(m.c.id)))
            return {
                str(i)
                for b in batches(sorted(set(among)))
                for i in conn.scalars(select(m.c.id).where(m.c.id.in_(b)))
            }
