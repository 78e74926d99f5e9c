"""What a take writes: the dedup oracle, durable packs, and the commit point.

Every call here runs under the writer's lease (``sessions``): the lease is checked in the same
transaction as the write, and every chunk the index reports or records is pinned to the
session, so gc cannot collect it before the snapshot that uses it is committed. The commit is
one transaction (reliability contract I1): the snapshot exists iff :meth:`commit_snapshot`
returns. Its phases are in ``_commit``, the rules for its names in ``_refnames``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import select

from ckstore.index import _commit, _convert, _refnames, _sql
from ckstore.index._batches import batches, unique
from ckstore.index._sql import check_lease, insert_ignore
from ckstore.index.base import IndexBase
from ckstore.index.records import ChunkRecord, EntryRecord, PackRecord, SnapshotRecord


class TakeWrites(IndexBase):
    """The dedup oracle and the commit point of a take."""

    def lookup_chunks(self, session_id: str, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """Returns the chunks among ``chunk_ids`` the index has, pinning each to the session.

        The lease check, the lookup and the pins happen in one transaction, so a chunk
        reported here cannot be collected while the lease is valid.

        Raises:
            LeaseExpiredError: If the session's lease is no longer valid (nothing is pinned).
        """
        ids = sorted(unique(chunk_ids))
        c = _sql.chunks
        found: dict[str, ChunkRecord] = {}
        with self._write(f"look up chunks for session {session_id}") as conn:
            check_lease(conn, session_id)
            for batch in batches(ids):
                query = select(c).where(c.c.id.in_(batch)).order_by(c.c.id)
                # PostgreSQL: FOR KEY SHARE keeps a concurrent GC from deleting these rows
                # before the pins below commit. In id order, as a compaction, a relocation and
                # a commit lock chunk rows: in another order a compaction's FOR UPDATE and
                # this waited on each other (PostgreSQL: "deadlock detected").
                rows = conn.execute(query.with_for_update(read=True, key_share=True)).all()
                insert_ignore(
                    conn, _sql.pins, [{"session_id": session_id, "chunk_id": r.id} for r in rows]
                )
                found.update((r.id, _convert.chunk(r)) for r in rows)
        return found

    def add_pack(self, session_id: str, pack: PackRecord, chunks: Sequence[ChunkRecord]) -> None:
        """Records a durable pack and its chunks, pinning every chunk to the session.

        Idempotent: a pack or chunk id already present is left as it is (the first location
        recorded for a chunk stays its location).

        Raises:
            LeaseExpiredError: If the session's lease is no longer valid.
            InvalidInputError: If a chunk claims to live in another pack.
        """
        _commit.check_pack(pack, chunks)
        with self._write(f"add pack {pack.pack_id}") as conn:
            now = check_lease(conn, session_id, share=True)  # recorded before any expiry
            _commit.add_pack(conn, pack, chunks, now, pin_for=session_id)

    def commit_snapshot(
        self,
        session_id: str,
        snapshot: SnapshotRecord,
        entries: Sequence[EntryRecord],
        chunk_ids: Iterable[str],
        manifest_size: int,
        tags: Sequence[str] = (),
        packs: Sequence[tuple[PackRecord, Sequence[ChunkRecord]]] = (),
        staged: str | None = None,
    ) -> SnapshotRecord:
        """Commits a snapshot in one transaction; the snapshot exists iff this returns.

        In order: the session must be active and unexpired; ``packs`` (durable packs this take
        wrote and did not :meth:`add_pack`: one transaction for both, the last pack of a small
        take typically) are recorded with their chunks; every chunk id must be in the
        index; the names must keep their meaning (:meth:`check_take`); the run is created if
        missing; ``parent_id`` becomes the run's latest snapshot at commit time (the caller's
        value is ignored); the manifest and its entries are inserted unless the manifest id
        exists; the snapshot and its chunk references are inserted; each tag is created or
        moved to it; the session becomes committed and its pins are dropped.

        ``tags`` are specs (:func:`tag_specs`): ``"name"`` creates a tag and is refused if
        the tag exists at another snapshot; ``"+name"`` creates or moves it.

        ``staged`` names a second write session whose pins are chunk references of the
        snapshot too: a distributed take's ranks pin there the chunks their parts of the
        manifest name, so the committing process passes no chunk id it did not see itself.
        It must be active and unexpired as well; its pins become the snapshot's references
        (copied in the database) and it ends committed in the same transaction.

        Returns:
            The stored record, with ``parent_id`` filled in.

        Raises:
            LeaseExpiredError: If the lease is no longer valid.
            NotFoundError: If a chunk id is not in the index (the message names one).
            ConflictError: If the snapshot id or name is taken, a tag exists and may not move,
                a tag has the name of a run, or a new run the name of a tag.
            InvalidInputError: If the run, name or a tag name is invalid.
        """
        ids = unique(chunk_ids)
        for pack, chunks in packs:
            _commit.check_pack(pack, chunks)
        with self._write(f"commit snapshot {snapshot.id}") as conn:
            return _commit.commit(
                conn, session_id, snapshot, entries, ids, manifest_size, list(tags), packs, staged
            )

    def check_take(self, run: str, tags: Sequence[str] = (), name: str | None = None) -> None:
        """Refuses, before anything is written, a take the commit would refuse for its names:
        a tag (spec, see :meth:`commit_snapshot`) that exists and may not move, a tag named like
        a run with snapshots or a snapshot, a new run named like a tag or a snapshot, a
        snapshot ``name`` that is a tag's or a run's. The commit checks again.

        Raises:
            ConflictError: Naming the clash and what to do instead.
        """
        with self._read(f"check names for a take into run {run!r}") as conn:
            _refnames.check_take(conn, run, tags, name=name)
