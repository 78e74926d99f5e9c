"""A store's remotes (revisions 0006, 0007), and which of its snapshots each holds.

- ``remotes`` names the other stores this one pushes to and pulls from; one marked ``tier`` is
  its persistent tier (``ckstore.open(..., push_to=...)``): retention keeps every snapshot that
  a tier does not hold yet (:meth:`Remotes.unpushed_to_tiers`). ``store_id`` (0007) is the id
  of the store at its URL, recorded once (:meth:`Remotes.record_remote_store_id`) and compared
  by every open of the remote; :meth:`Remotes.remote_used` says whether a remote was used
  (never to be created anew).
- ``remote_snapshots`` records what a remote holds of this store (a push committed it there,
  a pull brought it from there, or a push found it there).

The rows of chunks the local tier evicted to a remote are ``tiering``'s; a remote is not
removed while some live only there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, exists, func, select, update

from ckstore.errors import ConflictError, NotFoundError
from ckstore.index import _convert, _sql
from ckstore.index._batches import batches, unique
from ckstore.index._sql import insert_ignore
from ckstore.index.base import IndexBase
from ckstore.index.names import validate_name
from ckstore.index.records import RemoteRecord, SnapshotRecord


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


class Remotes(IndexBase):
    """The remotes, and what each holds of this store."""

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
            # locked first: an eviction switching chunks there waits, or is counted below
            found = select(r.c.name).where(r.c.name == name).with_for_update()
            if conn.execute(found).first() is None:
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
        """Record that remote ``remote`` holds these snapshots (idempotent).

        Raises:
            NotFoundError: no remote of that name (removed meanwhile, by another process).
        """
        now = time.time() if now is None else now
        rows = [
            {"remote": remote, "snapshot_id": s, "pushed_at": now} for s in unique(snapshot_ids)
        ]
        r = _sql.remotes
        with self._write(f"record snapshots held by remote {remote!r}") as conn:
            if conn.execute(select(r.c.name).where(r.c.name == remote)).first() is None:
                raise NotFoundError(
                    f"remote {remote!r} is no longer one of this store's (removed by another "
                    "process?): add it again, or reopen the store without it as push_to"
                )
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
