"""Write sessions and their leases (reliability contract I4): begun by a take, kept alive by its
heartbeat, ended by its commit or abort, and expired by gc once the lease ran out.

A session pins the chunks its writer relies on (``writes``: the lookups and packs of a take);
gc leaves pinned chunks alone while the lease is valid. A session whose lease ran out is marked
``expired`` before gc prunes anything, loses its pins, and can never pin or commit again
(LeaseExpiredError).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, exists, func, select, update

from ckstore.errors import InvalidInputError, LeaseExpiredError, NotFoundError
from ckstore.index import _commit, _convert, _sql
from ckstore.index._sql import check_lease, insert
from ckstore.index.base import IndexBase
from ckstore.index.records import SessionRecord

FINAL_STATES = ("committed", "aborted")


@dataclass(frozen=True)
class HeldSession:
    """A write session still marked active, and what it keeps from gc.

    Attributes:
        session: The session (owner ``host:pid``, start, lease end).
        pinned_chunks: Chunks pinned to it (what it wrote, and what it dedups against).
        held_bytes: Stored bytes of those pinned chunks that no snapshot references: what
            gc cannot reclaim until the session commits, ends or its lease runs out.
    """

    session: SessionRecord
    pinned_chunks: int
    held_bytes: int

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        s = self.session
        return {
            "id": s.id,
            "owner": s.owner,
            "started_at": s.started_at,
            "heartbeat_at": s.heartbeat_at,
            "expires_at": s.expires_at,
            "expired": s.expires_at < now,
            "pinned_chunks": self.pinned_chunks,
            "held_bytes": self.held_bytes,
        }


class Sessions(IndexBase):
    """Write sessions: begin, heartbeat, end; and what gc asks of them."""

    # ------------------------------------------------------------ a writer's own
    def begin_session(self, owner: str, lease_seconds: float) -> SessionRecord:
        """Starts a write session holding a lease of ``lease_seconds``.

        Raises:
            InvalidInputError: If ``lease_seconds`` is not positive.
        """
        if not lease_seconds > 0:
            raise InvalidInputError(f"lease_seconds must be > 0, got {lease_seconds}")
        now = time.time()
        record = SessionRecord(
            id=uuid.uuid4().hex,
            owner=str(owner)[:255],
            started_at=now,
            heartbeat_at=now,
            expires_at=now + lease_seconds,
            state=_sql.ACTIVE,
        )
        with self._write("begin write session") as conn:
            conn.execute(insert(conn, _sql.sessions), dataclasses.asdict(record))
        return record

    def heartbeat(self, session_id: str, lease_seconds: float) -> None:
        """Extends an active, unexpired lease to ``lease_seconds`` from now.

        Raises:
            LeaseExpiredError: If the session is unknown, ended, or its lease already expired.
        """
        s = _sql.sessions
        with self._write(f"heartbeat session {session_id}") as conn:
            now = time.time()
            result = conn.execute(
                update(s)
                .where((s.c.id == session_id) & (s.c.state == _sql.ACTIVE))
                .where(s.c.expires_at >= now)
                .values(heartbeat_at=now, expires_at=now + lease_seconds)
            )
            if result.rowcount != 1:
                check_lease(conn, session_id)  # raises with the precise reason
                raise LeaseExpiredError(f"write session {session_id} could not be extended")

    def end_session(self, session_id: str, state: str) -> None:
        """Ends an active session as ``"committed"`` or ``"aborted"`` and drops its pins. A
        session that ended already (by its commit, a settle or its lease) keeps its state:
        ending a committed one as aborted changes nothing.

        Raises:
            InvalidInputError: For any other state.
            NotFoundError: If the session does not exist.
        """
        if state not in FINAL_STATES:
            raise InvalidInputError(f"a session ends as one of {FINAL_STATES}, not {state!r}")
        with self._write(f"end session {session_id}") as conn:
            if _commit.finish_session(conn, session_id, state) == 1:
                return
            s = _sql.sessions
            if conn.scalar(select(s.c.id).where(s.c.id == session_id)) is None:
                raise NotFoundError(f"no write session {session_id}")

    def settle_session(self, session_id: str) -> str | None:
        """Decide an active session's outcome from outside: abort it unless it already ended;
        return its final state (``"committed"``, ``"aborted"``, ``"expired"``), or None if it
        is unknown (ended sessions are purged a day after their end).

        A commit ends its sessions in its own transaction and checks them under a lock first,
        so this and a commit are ordered: what a process that lost word of a commit reads here
        is what happened, and a commit that had not happened yet never will (its lease check
        finds the session aborted)."""
        s = _sql.sessions
        with self._write(f"settle session {session_id}") as conn:
            aborted = conn.execute(
                update(s)
                .where((s.c.id == session_id) & (s.c.state == _sql.ACTIVE))
                .values(state="aborted", heartbeat_at=time.time())
            ).rowcount
            if aborted:
                conn.execute(delete(_sql.pins).where(_sql.pins.c.session_id == session_id))
                return "aborted"
            state = conn.scalar(select(s.c.state).where(s.c.id == session_id))
        return None if state is None else str(state)

    # ------------------------------------------------------------------ for gc
    def expire_sessions(
        self, now: float | None = None, purge_after: float = 86400.0, gone: Iterable[str] = ()
    ) -> int:
        """Mark active sessions past their lease ``expired``, and those in ``gone`` (ids of
        sessions whose process is known to be gone) too; drop pins of ended sessions.

        Also forgets ended sessions older than ``purge_after`` seconds. Returns how many
        sessions were expired now.
        """
        now = time.time() if now is None else now
        s, p = _sql.sessions, _sql.pins
        over = s.c.expires_at < now
        ids = sorted(set(gone))
        with self._write("expire write sessions") as conn:
            expired = conn.execute(
                update(s)
                .where((s.c.state == _sql.ACTIVE) & ((over | s.c.id.in_(ids)) if ids else over))
                .values(state=_sql.EXPIRED)
            ).rowcount
            ended = select(s.c.id).where(s.c.state != _sql.ACTIVE)
            conn.execute(delete(p).where(p.c.session_id.in_(ended)))
            conn.execute(
                delete(s).where((s.c.state != _sql.ACTIVE) & (s.c.heartbeat_at < now - purge_after))
            )
        return int(expired or 0)

    def live_sessions(self, started_before: float | None = None) -> list[SessionRecord]:
        """Active sessions whose lease has not run out (optionally begun before a time)."""
        s = _sql.sessions
        now = time.time()
        query = select(s).where((s.c.state == _sql.ACTIVE) & (s.c.expires_at >= now))
        if started_before is not None:
            query = query.where(s.c.started_at <= started_before)
        with self._read("list live sessions") as conn:
            return [_convert.session(r) for r in conn.execute(query)]

    def held_sessions(self) -> list[HeldSession]:
        """Sessions still marked active (live, or past their lease but not yet expired by a
        gc), oldest first, with the chunks they pin and the bytes only they keep."""
        s, p, c, sc = _sql.sessions, _sql.pins, _sql.chunks, _sql.snapshot_chunks
        unreferenced = ~exists(select(sc.c.chunk_id).where(sc.c.chunk_id == c.c.id))
        out = []
        with self._read("list held write sessions") as conn:
            rows = conn.execute(
                select(s).where(s.c.state == _sql.ACTIVE).order_by(s.c.started_at)
            ).all()
            for row in rows:
                mine = p.c.session_id == row.id
                pinned = conn.scalar(select(func.count()).select_from(p).where(mine))
                held = conn.scalar(
                    select(func.coalesce(func.sum(c.c.length), 0))
                    .select_from(p.join(c, c.c.id == p.c.chunk_id))
                    .where(mine & unreferenced)
                )
                out.append(HeldSession(_convert.session(row), int(pinned or 0), int(held or 0)))
        return out
