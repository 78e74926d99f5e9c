"""Tags: names that point at snapshots, created, moved, read and deleted.

Every write is a single atomic statement (an insert that does nothing on conflict, an upsert, or
an ``UPDATE ... WHERE version = :expected``), so concurrent writers on PostgreSQL at READ
COMMITTED cannot lose each other's moves, and exactly one of several compare-and-swap movers
wins. A tag never takes the name of a run (``_refnames``).
"""

from __future__ import annotations

import time

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError, InvalidInputError, NotFoundError, SnapshotNotFoundError
from ckstore.index import _commit, _convert, _sql
from ckstore.index._refnames import refuse_tag_hiding_a_name
from ckstore.index._sql import insert_ignore
from ckstore.index.base import IndexBase
from ckstore.index.names import validate_name
from ckstore.index.records import TagRecord


class Tags(IndexBase):
    """Tags: set (create, move, compare-and-swap), delete, get, list."""

    def set_tag(
        self,
        name: str,
        ref_snapshot_id: str,
        *,
        force: bool = False,
        expected_version: int | None = None,
    ) -> TagRecord:
        """Creates or moves a tag.

        Args:
            name: Tag name (see ``validate_name``).
            ref_snapshot_id: Id of the snapshot to point at.
            force: Move the tag if it exists.
            expected_version: Compare-and-swap: move only if the tag is at this version
                (0: create only if absent). Of several concurrent movers that read the same
                version exactly one wins.

        Returns:
            The tag as stored (version 1 when created, +1 per move).

        Raises:
            ConflictError: If the tag exists (no force, no expected_version) or moved since
                ``expected_version``.
            SnapshotNotFoundError: If the snapshot does not exist.
            InvalidInputError: If the name is invalid.
        """
        with self._write(f"tag {name!r}") as conn:
            return _set(conn, name, ref_snapshot_id, force, expected_version)

    def delete_tag(self, name: str) -> None:
        """Deletes a tag.

        Raises:
            NotFoundError: If there is no such tag.
        """
        with self._write(f"delete tag {name!r}") as conn:
            result = conn.execute(delete(_sql.tags).where(_sql.tags.c.name == name))
            if result.rowcount != 1:
                raise NotFoundError(f"no tag {name!r}")

    def get_tag(self, name: str) -> TagRecord | None:
        """Returns the tag, or None."""
        with self._read(f"read tag {name!r}") as conn:
            return _get(conn, name)

    def list_tags(self, snapshot_id: str | None = None) -> list[TagRecord]:
        """Lists tags by name, optionally only those pointing at ``snapshot_id``."""
        t = _sql.tags
        query = select(t).order_by(t.c.name)
        if snapshot_id is not None:
            query = query.where(t.c.snapshot_id == snapshot_id)
        with self._read("list tags") as conn:
            return [_convert.tag(r) for r in conn.execute(query)]


def _set(
    conn: Connection, name: str, snapshot_id: str, force: bool, expected_version: int | None
) -> TagRecord:
    validate_name(name, "tag")
    _sql.names_lock(conn)
    refuse_tag_hiding_a_name(conn, name)
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
    return _get(conn, name)  # type: ignore[return-value]


def _get(conn: Connection, name: str) -> TagRecord | None:
    row = conn.execute(select(_sql.tags).where(_sql.tags.c.name == name)).first()
    return None if row is None else _convert.tag(row)


def _create(conn: Connection, name: str, snapshot_id: str, now: float) -> None:
    row = {"name": name, "snapshot_id": snapshot_id, "version": 1, "updated_at": now}
    if insert_ignore(conn, _sql.tags, [row]) != 1:
        current = _get(conn, name)
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
        current = _get(conn, name)
        state = "was deleted" if current is None else f"is at version {current.version}"
        raise ConflictError(
            f"tag {name!r} moved concurrently: expected version {expected}, but it {state}; "
            "read it again and retry"
        )
