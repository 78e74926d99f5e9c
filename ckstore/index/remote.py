"""Index queries for remotes (mixed into :class:`Index`; revisions 0006, 0007): the store's
remotes, which of its snapshots each holds, and the rows of chunks the local tier evicted to one.

- ``remotes`` names the other stores this one pushes to and pulls from; one marked ``tier`` is
  its persistent tier (``ckstore.open(..., push_to=...)``): retention keeps every snapshot that
  a tier does not hold yet (:meth:`RemotesMixin.unpushed_to_tiers`). ``store_id`` (0007) is
  the id of the store at its URL, recorded once (:meth:`RemotesMixin.record_remote_store_id`)
  and compared by every open of the remote; :meth:`RemotesMixin.remote_used` says whether a
  remote was used (never to be created anew).
- ``remote_snapshots`` records what a remote holds of this store (a push committed it there,
  a pull brought it from there, or a push found it there).
- A chunk *evicted* from the local tier keeps its row, pointed at the remote's own place for
  it: a pack row marked ``remote`` (a pack of that remote), so a read goes there (with no
  payload digest: the remote's proves nothing). Its delta
  base (the remote's, which the store may not have had) gets a row too.
  :meth:`RemotesMixin.point_chunks_at_remote` switches rows in one transaction, keeping the
  chain depths exact (a chunk's depth is its base's plus one, dependents follow) and leaving
  alone any chunk a live write session relies on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError, NotFoundError
from ckstore.index import _convert, _sql
from ckstore.index._sql import batches, insert_ignore, unique
from ckstore.index.names import validate_name
from ckstore.index.records import ChunkRecord, RemoteRecord, SnapshotRecord

MAX_DEPTH = 64
"""Deepest chain a switch may build (readers refuse longer ones, ``objects.delta.MAX_CHAIN``)."""


def _remote(row: Any) -> RemoteRecord:
    options = json.loads(row.options) if row.options else {}
    return RemoteRecord(
        row.name,
        row.url,
        row.index_url,
        options if isinstance(options, dict) else {},
        bool(row.tier),
        float(row.created_at),
        None if row.store_id is None else str(row.store_id),
    )


class RemotesMixin:
    """Remote queries; relies on ``Index._write`` / ``Index._read``."""

    def _write(self, what: str) -> AbstractContextManager[Connection]:  # provided by Index
        raise NotImplementedError

    def _read(self, what: str) -> AbstractContextManager[Connection]:  # provided by Index
        raise NotImplementedError

    # ------------------------------------------------------------------ the remotes
    def add_remote(self, remote: RemoteRecord) -> RemoteRecord:
        """Add a remote; returns it as stored.

        Raises:
            InvalidInputError: the name breaks the naming rules (``validate_name``).
            ConflictError: a remote of that name exists (the message names its URL).
        """
        validate_name(remote.name, "remote")
        row = {
            "name": remote.name,
            "url": remote.url,
            "index_url": remote.index,
            "options": json.dumps(remote.options, sort_keys=True),
            "tier": remote.tier,
            "created_at": remote.created_at or time.time(),
            "store_id": remote.store_id,
        }
        with self._write(f"add remote {remote.name!r}") as conn:
            if insert_ignore(conn, _sql.remotes, [row]) != 1:
                held = conn.execute(
                    select(_sql.remotes).where(_sql.remotes.c.name == remote.name)
                ).one()
                raise ConflictError(
                    f"a remote named {remote.name!r} exists already ({held.url}): remove it first "
                    f"(`ckstore remote rm {remote.name}`) or choose another name"
                )
            return _remote(
                conn.execute(select(_sql.remotes).where(_sql.remotes.c.name == remote.name)).one()
            )

    def get_remote(self, name: str) -> RemoteRecord | None:
        """The remote named ``name``, or None."""
        with self._read(f"read remote {name!r}") as conn:
            row = conn.execute(select(_sql.remotes).where(_sql.remotes.c.name == name)).first()
            return None if row is None else _remote(row)

    def list_remotes(self) -> list[RemoteRecord]:
        """Every remote, by name."""
        with self._read("list remotes") as conn:
            return [
                _remote(r) for r in conn.execute(select(_sql.remotes).order_by(_sql.remotes.c.name))
            ]

    def record_remote_store_id(self, name: str, store_id: str) -> str | None:
        """Record the id of the store found at remote ``name``'s URL, unless one is recorded
        already (a compare-and-set); returns the id recorded now (None: no such remote)."""
        r = _sql.remotes
        with self._write(f"record the store id of remote {name!r}") as conn:
            conn.execute(
                update(r)
                .where((r.c.name == name) & r.c.store_id.is_(None))
                .values(store_id=store_id)
            )
            found = conn.scalar(select(r.c.store_id).where(r.c.name == name))
            return None if found is None else str(found)

    def remote_used(self, name: str) -> bool:
        """Whether remote ``name`` was ever used: a store id is recorded for it, it is known to
        hold snapshots of this store, or rows of evicted chunks point at its packs."""
        r, rs, p = _sql.remotes, _sql.remote_snapshots, _sql.packs
        with self._read(f"find uses of remote {name!r}") as conn:
            return (
                conn.scalar(select(r.c.store_id).where(r.c.name == name)) is not None
                or conn.scalar(select(rs.c.snapshot_id).where(rs.c.remote == name).limit(1))
                is not None
                or conn.scalar(select(p.c.id).where(p.c.remote == name).limit(1)) is not None
            )

    def set_remote_tier(self, name: str, tier: bool) -> None:
        """Mark (or unmark) remote ``name`` as the store's persistent tier.

        Raises:
            NotFoundError: no such remote.
        """
        with self._write(f"mark remote {name!r}") as conn:
            done = conn.execute(
                update(_sql.remotes).where(_sql.remotes.c.name == name).values(tier=tier)
            ).rowcount
            if done != 1:
                raise NotFoundError(f"no remote named {name!r}")

    def remove_remote(self, name: str) -> None:
        """Forget remote ``name`` and what it holds (the remote store itself is untouched).

        Raises:
            NotFoundError: no such remote.
            ConflictError: chunks of this store live only there (evicted under a local budget);
                the message says how many.
        """
        c, p, r = _sql.chunks, _sql.packs, _sql.remotes
        with self._write(f"remove remote {name!r}") as conn:
            if conn.execute(select(r.c.name).where(r.c.name == name)).first() is None:
                raise NotFoundError(f"no remote named {name!r}")
            held = conn.scalar(
                select(func.count(c.c.id))
                .select_from(c.join(p, p.c.id == c.c.pack_id))
                .where(p.c.remote == name)
            )
            if held:
                raise ConflictError(
                    f"{held} chunk(s) of this store live only at remote {name!r} (the local tier evicted "
                    "them under its budget): bring them back first (store.hydrate(), opened without "
                    "local_budget), then remove the remote"
                )
            conn.execute(delete(p).where(p.c.remote == name))
            conn.execute(
                delete(_sql.remote_snapshots).where(_sql.remote_snapshots.c.remote == name)
            )
            conn.execute(delete(r).where(r.c.name == name))

    # ------------------------------------------------------- what the remotes hold
    def mark_pushed(
        self, remote: str, snapshot_ids: Iterable[str], now: float | None = None
    ) -> None:
        """Record that remote ``remote`` holds these snapshots (idempotent)."""
        now = time.time() if now is None else now
        rows = [
            {"remote": remote, "snapshot_id": s, "pushed_at": now} for s in unique(snapshot_ids)
        ]
        with self._write(f"record snapshots held by remote {remote!r}") as conn:
            for batch in batches(rows):
                insert_ignore(conn, _sql.remote_snapshots, batch)

    def unmark_pushed(self, remote: str, snapshot_ids: Iterable[str]) -> None:
        """Forget that remote ``remote`` holds these snapshots (it was found not to): they are
        ``pushing`` again, and pushed again."""
        rs = _sql.remote_snapshots
        with self._write(f"forget snapshots held by remote {remote!r}") as conn:
            for batch in batches(unique(snapshot_ids)):
                conn.execute(
                    delete(rs).where((rs.c.remote == remote) & rs.c.snapshot_id.in_(batch))
                )

    def held_by(self, remote: str) -> set[str]:
        """Ids of the snapshots remote ``remote`` is known to hold (recorded here)."""
        rs = _sql.remote_snapshots
        with self._read(f"list snapshots held by remote {remote!r}") as conn:
            return {
                str(i) for i in conn.scalars(select(rs.c.snapshot_id).where(rs.c.remote == remote))
            }

    def snapshot_ids(self, snapshot_ids: Iterable[str]) -> set[str]:
        """Those of ``snapshot_ids`` this index holds."""
        s = _sql.snapshots
        found: set[str] = set()
        with self._read("find snapshots") as conn:
            for batch in batches(unique(snapshot_ids)):
                found.update(str(i) for i in conn.scalars(select(s.c.id).where(s.c.id.in_(batch))))
        return found

    def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """Pack id -> its recorded size in bytes, for the packs among ``pack_ids`` with a row."""
        p = _sql.packs
        out: dict[str, int] = {}
        with self._read("read pack sizes") as conn:
            for batch in batches(unique(pack_ids)):
                out.update(
                    (str(i), int(n))
                    for i, n in conn.execute(select(p.c.id, p.c.size).where(p.c.id.in_(batch)))
                )
        return out

    def remote_holdings(self) -> dict[str, set[str]]:
        """Snapshot id -> the remotes known to hold it (snapshots no remote holds are left out)."""
        rs, s = _sql.remote_snapshots, _sql.snapshots
        query = select(rs.c.snapshot_id, rs.c.remote).join(s, s.c.id == rs.c.snapshot_id)
        out: dict[str, set[str]] = {}
        with self._read("list snapshots held by remotes") as conn:
            for sid, remote in conn.execute(query):
                out.setdefault(str(sid), set()).add(str(remote))
        return out

    def unpushed(self, remote: str) -> list[SnapshotRecord]:
        """The snapshots remote ``remote`` is not known to hold, run by run in commit order."""
        s, rs = _sql.snapshots, _sql.remote_snapshots
        held = exists(
            select(rs.c.snapshot_id).where((rs.c.remote == remote) & (rs.c.snapshot_id == s.c.id))
        )
        query = select(s).where(~held).order_by(s.c.run, s.c.seq)
        with self._read(f"list snapshots not at remote {remote!r}") as conn:
            return [_convert.snapshot(r) for r in conn.execute(query)]

    def unpushed_to_tiers(self) -> set[str]:
        """Ids of the snapshots some tier remote does not hold yet (what retention must keep)."""
        s, rs, r = _sql.snapshots, _sql.remote_snapshots, _sql.remotes
        out: set[str] = set()
        with self._read("list snapshots not yet at the tier") as conn:
            for tier in conn.scalars(select(r.c.name).where(r.c.tier.is_(True))):
                held = exists(
                    select(rs.c.snapshot_id).where(
                        (rs.c.remote == tier) & (rs.c.snapshot_id == s.c.id)
                    )
                )
                out.update(str(i) for i in conn.scalars(select(s.c.id).where(~held)))
        return out

    def pushed_chunk_ids(self, remote: str, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` that a snapshot remote ``remote`` holds references (so the
        remote keeps them as long as it keeps that snapshot)."""
        sc, rs = _sql.snapshot_chunks, _sql.remote_snapshots
        held = exists(
            select(rs.c.snapshot_id).where(
                (rs.c.remote == remote) & (rs.c.snapshot_id == sc.c.snapshot_id)
            )
        )
        found: set[str] = set()
        with self._read(f"find chunks held by remote {remote!r}") as conn:
            for b in batches(unique(chunk_ids)):
                found.update(
                    str(i)
                    for i in conn.scalars(
                        select(sc.c.chunk_id).where(sc.c.chunk_id.in_(b) & held).distinct()
                    )
                )
        return found

    # ------------------------------------------------------------ packs and chunks
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
        chain would grow past :data:`MAX_DEPTH`, or if its base has no row.
        """
        c, p = _sql.chunks, _sql.packs
        done: list[str] = []
        with self._write(f"point chunks at remote {remote!r}") as conn:
            _sql.gc_barrier(conn)
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
                depth = self._depth_of_base(conn, rec)
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
                if self._switch(conn, rec, depth, int(old.depth)):
                    done.append(rec.chunk_id)
        return done

    @staticmethod
    def _depth_of_base(conn: Connection, rec: ChunkRecord) -> int | None:
        """The depth ``rec`` gets here: 0 whole, else its base's plus one (None: no base row)."""
        if rec.base_id is None:
            return 0
        base = conn.scalar(select(_sql.chunks.c.depth).where(_sql.chunks.c.id == rec.base_id))
        return None if base is None else int(base) + 1

    @staticmethod
    def _switch(conn: Connection, rec: ChunkRecord, depth: int, old_depth: int) -> bool:
        """Switch one row (already locked) and shift its dependents' depths; False if refused."""
        c, pins = _sql.chunks, _sql.pins
        tree = [rec.chunk_id]
        if depth != old_depth:  # every delta stored against it, at any distance, moves too
            todo = [rec.chunk_id]
            while todo:
                found = [
                    str(i)
                    for b in batches(todo)
                    for i in conn.scalars(
                        select(c.c.id).where(c.c.base_id.in_(b)).with_for_update()
                    )
                ]
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
