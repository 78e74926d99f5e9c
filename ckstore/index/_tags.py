"""Tag writes: create, force-move and compare-and-swap move.

Every write is a single atomic statement (an insert that does nothing on conflict, an upsert, or
an ``UPDATE ... WHERE version = :expected``), so concurrent writers on PostgreSQL at READ
COMMITTED cannot lose each other's moves, and exactly one of several CAS movers wins.
"""

from __future__ import annotations

import time

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError, InvalidInputError, SnapshotNotFoundError
from ckstore.index import _commit, _convert, _sql
from ckstore.index._refnames import refuse_tag_named_like_a_run
from ckstore.index._sql import insert_ignore
from ckstore.index.names import validate_name
from ckstore.index.records import TagRecord


def set_tag(
    conn: Connection,
    name: str,
    snapshot_id: str,
    *,
    force: bool,
    expected_version: int | None,
) -> TagRecord:
    """Creates or moves a tag; see :meth:`ckstore.index.Index.set_tag` for the contract."""
    validate_name(name, "tag")
    refuse_tag_named_like_a_run(conn, name)
    s = _sql.snapshots
    if not conn.scalar(select(func.count()).where(s.c.id == snapshot_id)):
        raise SnapshotNotFoundError(f"cannot tag {name!r}: no snapshot with id {snapshot_id}")
    now = time.time()
    if expected_version is not None:
        _compare_and_swap(conn, name, snapshot_id, expected_version, now)
    elif force:
        _commit.move_tag(conn, name, snapshot_id, now)
    else:
        _create(conn, name, snapshot_id, now)
    return get_tag(conn, name)  # type: ignore[return-value]


def get_tag(conn: Connection, name: str) -> TagRecord | None:
    """Returns the tag, or None."""
    row = conn.execute(select(_sql.tags).where(_sql.tags.c.name == name)).first()
    return None if row is None else _convert.tag(row)


def _create(conn: Connection, name: str, snapshot_id: str, now: float) -> None:
    row = {"name": name, "snapshot_id": snapshot_id, "version": 1, "updated_at": now}
    if insert_ignore(conn, _sql.tags, [row]) != 1:
        current = get_tag(conn, name)
        where = f" (at snapshot {current.snapshot_id})" if current else ""
        raise ConflictError(f"tag {name!r} already exists{where}; pass force=True to move it")


def _compare_and_swap(
    conn: Connection, name: str, snapshot_id: str, expected: int, now: float
) -> None:
    if expected < 0:
        raise InvalidInputError(f"expected_version must be >= 0, got {expected}")
    if expected == 0:  # 0: the caller saw no tag; create only
        row = {"name": name, "snapshot_id": snapshot_id, "version": 1, "updated_at": now}
        if insert_ignore(conn, _sql.tags, [row]) != 1:
            raise ConflictError(f"tag {name!r} was created concurrently (expected no tag)")
        return
    t = _sql.tags
    result = conn.execute(
        update(t)
        .where((t.c.name == name) & (t.c.version == expected))
        .values(snapshot_id=snapshot_id, version=t.c.version + 1, updated_at=now)
    )
    if result.rowcount != 1:
        current = get_tag(conn, name)
        state = "was deleted" if current is None else f"is at version {current.version}"
        raise ConflictError(
            f"tag {name!r} moved concurrently: expected version {expected}, but it {state}; "
            "read it again and retry"
        )
