"""Index edits of history (mixed into :class:`~ckstore.index.index.Index`): tags set, moved
and deleted, and snapshots or whole runs deleted. Each is one transaction, atomic as every
index method; chunk, pack and manifest rows are left for GC."""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError, NotFoundError, SnapshotNotFoundError
from ckstore.index import _convert, _sql, _tags
from ckstore.index._sql import batches
from ckstore.index.records import SnapshotRecord, TagRecord


class EditsMixin:
    """Tags and deletions; relies on ``Index._write`` / ``Index._read``."""

    def _write(self, what: str) -> AbstractContextManager[Connection]:  # provided by Index
        raise NotImplementedError

    def _read(self, what: str) -> AbstractContextManager[Connection]:  # provided by Index
        raise NotImplementedError

    # ---------------------------------------------------------------------- tags
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
            return _tags.set_tag(
                conn, name, ref_snapshot_id, force=force, expected_version=expected_version
            )

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
            return _tags.get_tag(conn, name)

    def list_tags(self, snapshot_id: str | None = None) -> list[TagRecord]:
        """Lists tags by name, optionally only those pointing at ``snapshot_id``."""
        t = _sql.tags
        query = select(t).order_by(t.c.name)
        if snapshot_id is not None:
            query = query.where(t.c.snapshot_id == snapshot_id)
        with self._read("list tags") as conn:
            return [_convert.tag(r) for r in conn.execute(query)]

    # -------------------------------------------------------------------- delete
    def delete_snapshot(self, snapshot_id: str, *, refuse_tagged: bool = False) -> None:
        """Deletes a snapshot, its chunk references and the tags pointing at it.

        Its children get its parent as their parent, so run history stays a chain. Chunk,
        pack and manifest rows are left for GC.

        Args:
            snapshot_id: The snapshot to delete.
            refuse_tagged: Delete nothing if a tag points at it, checked in the same
                transaction (a tag set concurrently is either seen or waits for the delete).

        Raises:
            SnapshotNotFoundError: If there is no such snapshot.
            ConflictError: If ``refuse_tagged`` and tags point at it (the message names them).
        """
        s, sc, t = _sql.snapshots, _sql.snapshot_chunks, _sql.tags
        with self._write(f"delete snapshot {snapshot_id}") as conn:
            row = conn.execute(
                select(s.c.parent_id).where(s.c.id == snapshot_id).with_for_update()
            ).first()
            if row is None:
                raise SnapshotNotFoundError(f"no snapshot with id {snapshot_id}")
            if refuse_tagged:
                names = conn.scalars(
                    select(t.c.name).where(t.c.snapshot_id == snapshot_id).order_by(t.c.name)
                ).all()
                if names:
                    raise ConflictError(
                        f"snapshot {snapshot_id} is tagged {', '.join(names)}; delete the "
                        "tags first, or delete it with its tags (force)"
                    )
            children = update(s).where(s.c.parent_id == snapshot_id)
            conn.execute(children.values(parent_id=row.parent_id))
            conn.execute(delete(t).where(t.c.snapshot_id == snapshot_id))
            conn.execute(delete(sc).where(sc.c.snapshot_id == snapshot_id))
            conn.execute(delete(s).where(s.c.id == snapshot_id))

    def delete_run(self, run: str, *, refuse_tagged: bool = False) -> list[SnapshotRecord]:
        """Deletes every snapshot of ``run``, their chunk references and tags, and the run, in
        one transaction (all or nothing). Chunk, pack and manifest rows are left for GC.

        Args:
            run: The run to delete.
            refuse_tagged: Delete nothing if a tag points at one of its snapshots.

        Returns:
            The deleted snapshots, newest first.

        Raises:
            NotFoundError: If the run has no snapshot.
            ConflictError: If ``refuse_tagged`` and tags point at its snapshots (named).
        """
        s, sc, t = _sql.snapshots, _sql.snapshot_chunks, _sql.tags
        with self._write(f"delete run {run!r}") as conn:
            rows = conn.execute(
                select(s).where(s.c.run == run).order_by(s.c.seq.desc()).with_for_update()
            ).all()
            if not rows:
                raise NotFoundError(f"no run {run!r} (it has no snapshot)")
            ids = [r.id for r in rows]
            tagged = conn.execute(
                select(t.c.name, t.c.snapshot_id).where(t.c.snapshot_id.in_(ids))
            ).all()
            if refuse_tagged and tagged:
                names = ", ".join(sorted(r.name for r in tagged))
                raise ConflictError(
                    f"run {run!r} has tagged snapshots ({names}); delete the tags first, or "
                    "delete the run with its tags (force)"
                )
            for batch in batches(ids):
                conn.execute(delete(t).where(t.c.snapshot_id.in_(batch)))
                conn.execute(delete(sc).where(sc.c.snapshot_id.in_(batch)))
                conn.execute(delete(s).where(s.c.id.in_(batch)))
            conn.execute(delete(_sql.runs).where(_sql.runs.c.name == run))
            return [_convert.snapshot(r) for r in rows]
