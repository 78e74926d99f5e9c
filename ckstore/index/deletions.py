"""Deleting history: one snapshot, or a whole run, with the tags that point at them.

Each deletion is one transaction, all or nothing. Only the snapshot rows, their chunk
references and their tags go: chunk, pack and manifest rows are left for gc, which reclaims
what no snapshot references any more (``maintenance``).
"""

from __future__ import annotations

from sqlalchemy import delete, select, update

from ckstore.errors import ConflictError, NotFoundError, SnapshotNotFoundError
from ckstore.index import _convert, _sql
from ckstore.index._batches import batches
from ckstore.index.base import IndexBase
from ckstore.index.records import SnapshotRecord


class Deletions(IndexBase):
    """Delete a snapshot or a run."""

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
            run = conn.scalar(select(s.c.run).where(s.c.id == snapshot_id))
            if run is not None:  # as a commit to the run does: its new snapshot's parent is
                _sql.lock_run_row(conn, run)  # read under this lock: never the one deleted here
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
            _sql.lock_run_row(conn, run)  # first, as a commit and delete_snapshot take it
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
