"""Shared SQL building blocks: table handles, dialect-aware inserts, batching, lease checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Table, func, select, text
from sqlalchemy.engine import Connection

from ckstore.errors import LeaseExpiredError
from ckstore.index import models
from ckstore.index._batches import batches

meta = models.meta
packs = models.packs
chunks = models.chunks
manifests = models.manifests
manifest_entries = models.manifest_entries
runs = models.runs
snapshots = models.snapshots
snapshot_chunks = models.snapshot_chunks
tags = models.tags
sessions = models.sessions
pins = models.pins
remotes = models.remotes
remote_snapshots = models.remote_snapshots


def healthy() -> ColumnElement[bool]:
    """The rows of healthy snapshots (``SnapshotRecord.healthy``, ``run@healthy``): NaN and Inf
    counted and none found, no stale tensor, no replicas that disagree (NULL: not checked)."""
    s = snapshots
    return (
        (s.c.nonfinite == 0)
        & (func.coalesce(s.c.stale, 0) == 0)
        & (func.coalesce(s.c.diverged, 0) == 0)
    )


ACTIVE = "active"
EXPIRED = "expired"
SESSION_STATES = ("active", "committed", "aborted", "expired")


def insert(conn: Connection, table: Table) -> Any:
    """Returns the dialect's INSERT (which supports ``on_conflict_do_nothing``/``_do_update``)."""
    if conn.dialect.name == "postgresql":  # imported here: the SQLite-only case never loads it
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)


def insert_ignore(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> int:
    """Inserts rows, leaving rows whose primary key already exists as they are.

    Returns:
        The number of rows inserted (exact for a single row; -1 for several).
    """
    if not rows:
        return 0
    keys = list(table.primary_key.columns)
    stmt = insert(conn, table).on_conflict_do_nothing(index_elements=keys)
    if len(rows) == 1:  # RETURNING lists only inserted rows; rowcount is not reliable here
        return len(conn.execute(stmt.returning(keys[0]), rows[0]).all())
    conn.execute(stmt, list(rows))
    return -1


GC_BARRIER_KEY = 0x636B_7374_6763  # an advisory-lock key of our own ("ckstgc")


def gc_barrier(conn: Connection, *, exclusive: bool = False) -> None:
    """Serialise GC's prune against writers on PostgreSQL (SQLite already serialises writes).

    Every transaction that relies on a lease (lookup + pin, add_pack, commit) takes this
    transaction-scoped advisory lock shared, as its first statement; GC's prune takes it
    exclusive. So prune sees no half-done pin or commit, and since the barrier is always the
    first lock anyone takes, it adds no lock-order cycle (no deadlocks).
    """
    if conn.dialect.name == "postgresql":
        fn = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        conn.execute(text(f"SELECT {fn}(:key)"), {"key": GC_BARRIER_KEY})


NAMES_KEY = 0x636B_7374_6E6D  # an advisory-lock key of our own ("ckstnm")


def names_lock(conn: Connection) -> None:
    """Serialise the transactions that give a name a meaning on PostgreSQL (SQLite already
    serialises writes): a tag created or moved, a commit that starts a run, names a snapshot or
    tags it. The rules of ``_refnames`` read one table and write another, and under READ
    COMMITTED two such transactions would each pass the other's check unseen (a tag and a run
    of one name; two takes both creating one tag). Taken before the rules are read and held to
    the transaction's end: by a commit after its run's row lock (:func:`lock_run_row`), by a
    tag's change first; both touch tag rows only after it, so the locks keep one order."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": NAMES_KEY})


def lock_run_row(conn: Connection, run: str) -> None:
    """Lock ``run``'s row (PostgreSQL ``FOR UPDATE``): the first row lock of every transaction
    that changes the run's snapshots (a commit to it, the delete of one of its snapshots, the
    delete of the run). One order, so they never wait on each other in a cycle, and a commit
    reads the run's head and the name rules with no delete of the run's snapshots half done."""
    conn.execute(select(runs.c.name).where(runs.c.name == run).with_for_update())


def check_lease(
    conn: Connection, session_id: str, *, lock: bool = False, share: bool = False
) -> float:
    """Checks that a write session is active and unexpired; returns the current time.

    Args:
        conn: Connection inside the caller's transaction.
        session_id: The session to check.
        lock: Lock the session row until the transaction ends (PostgreSQL ``FOR UPDATE``), so
            nothing expires or ends it between this check and the commit.
        share: Lock the session row shared (PostgreSQL ``FOR SHARE``): several of the
            session's own writes may run at once, but nothing expires or ends it before this
            transaction ends (a gc's orphan sweep expires the sessions it outlives first).

    Raises:
        LeaseExpiredError: If the session is unknown, no longer active, or past its lease.
    """
    gc_barrier(conn)
    query = select(sessions.c.state, sessions.c.expires_at).where(sessions.c.id == session_id)
    if lock:
        query = query.with_for_update()
    elif share:
        query = query.with_for_update(read=True)
    row = conn.execute(query).first()
    now = time.time()
    if row is None:
        raise LeaseExpiredError(f"write session {session_id} is unknown (expired and purged?)")
    if row.state != ACTIVE:
        raise LeaseExpiredError(f"write session {session_id} is {row.state}, not active")
    if row.expires_at < now:
        raise LeaseExpiredError(
            f"write session {session_id}'s lease expired {now - row.expires_at:.3f}s ago; "
            "heartbeat more often or use a longer lease"
        )
    return now


def existing_chunk_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    """Returns which of ``ids`` have a row in ``chunks`` (batched)."""
    found: set[str] = set()
    for batch in batches(ids):
        found.update(conn.scalars(select(chunks.c.id).where(chunks.c.id.in_(batch))))
    return found
