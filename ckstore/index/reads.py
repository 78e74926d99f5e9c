"""What readers ask: snapshots (by id, by ref, by run), their entries and chunks, and where
chunks are.

Read-only, each call one read transaction, so what it returns is one consistent view (a
delta chain in :meth:`Reads.chunk_locations` is seen whole). How a ref is resolved is in
``_resolve``.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import ColumnElement, func, select

from ckstore.errors import InvalidInputError, SnapshotNotFoundError
from ckstore.index import _convert, _resolve, _sql
from ckstore.index._batches import batches, unique
from ckstore.index.base import IndexBase
from ckstore.index.records import ChunkRecord, EntryRecord, SnapshotRecord

MAX_CHAIN_ROUNDS = 65
"""Lookups :meth:`Reads.chunk_locations` makes to follow delta chains (one per link; chains
are far shorter, and readers refuse one over 64 links)."""


class Reads(IndexBase):
    """Snapshots, their entries and chunks, and chunk locations."""

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """Returns the snapshot with this exact id.

        Raises:
            SnapshotNotFoundError: If there is none.
        """
        missing = f"no snapshot with id {snapshot_id}"
        return self._snapshot_where(_sql.snapshots.c.id == snapshot_id, snapshot_id, missing)

    def snapshot_named(self, name: str) -> SnapshotRecord:
        """Returns the snapshot named ``name`` (its ``name``: a TorchSnapshot path's), and
        nothing else a ref could mean (a tag, a run, an id prefix).

        Raises:
            SnapshotNotFoundError: If no snapshot has that name.
        """
        missing = f"no snapshot was taken at {name!r} (its name)"
        return self._snapshot_where(_sql.snapshots.c.name == name, repr(name), missing)

    def _snapshot_where(
        self, where: ColumnElement[bool], what: str, missing: str
    ) -> SnapshotRecord:
        with self._read(f"read snapshot {what}") as conn:
            row = conn.execute(select(_sql.snapshots).where(where)).first()
            if row is None:
                raise SnapshotNotFoundError(missing)
            return _convert.snapshot(row)

    def resolve(self, ref: str) -> SnapshotRecord:
        """Finds the snapshot a ref names.

        Tried in order: ``run@step`` (the newest snapshot of that run at that step), a tag, a
        snapshot name, a run name (its latest snapshot), a snapshot id or a hex id prefix of at
        least 4 characters.

        Raises:
            SnapshotNotFoundError: If nothing matches (the message lists what was tried and a
                few known runs and tags).
            InvalidInputError: If an id prefix is ambiguous (the message lists candidates).
        """
        with self._read(f"resolve {ref!r}") as conn:
            return _convert.snapshot(_resolve.resolve(conn, ref))

    def list_snapshots(
        self, run: str | None = None, limit: int | None = None, *, healthy: bool = False
    ) -> list[SnapshotRecord]:
        """Lists snapshots newest first: by commit order within a run, else by created_at.

        ``healthy`` keeps only healthy snapshots (``SnapshotRecord.healthy``: NaN and Inf
        counted and none found, no stale tensor, no replicas that disagree; those without a
        record are unknown and left out), from the index alone.

        Raises:
            InvalidInputError: If ``limit`` is not None or an int from 0 to 2**63-1.
        """
        if limit is not None and (
            not isinstance(limit, int)
            or isinstance(limit, bool)
            or not 0 <= limit <= _resolve.MAX_STEP
        ):
            raise InvalidInputError(
                f"limit must be None or an int from 0 to 2**63-1, got {limit!r}"
            )
        s = _sql.snapshots
        query = select(s)
        if healthy:
            query = query.where(_sql.healthy())
        if run is not None:
            query = query.where(s.c.run == run).order_by(s.c.seq.desc())
        else:
            query = query.order_by(s.c.created_at.desc(), s.c.seq.desc(), s.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        with self._read("list snapshots") as conn:
            return [_convert.snapshot(r) for r in conn.execute(query)]

    def at_step(self, run: str, step: int) -> SnapshotRecord | None:
        """The newest snapshot of ``run`` at ``step`` (what ``run@step`` names), or None: one
        indexed lookup, cheap enough before every take."""
        s = _sql.snapshots
        query = (
            select(s).where((s.c.run == run) & (s.c.step == step)).order_by(s.c.seq.desc()).limit(1)
        )
        with self._read(f"look up {run}@{step}") as conn:
            row = conn.execute(query).first()
        return None if row is None else _convert.snapshot(row)

    def list_runs(self) -> list[str]:
        """Lists the names of runs that have snapshots, in name order (a run whose snapshots
        were all deleted is not listed)."""
        s = _sql.snapshots
        with self._read("list runs") as conn:
            return list(conn.scalars(select(s.c.run).distinct().order_by(s.c.run)))

    def entries(self, manifest_id: str) -> list[EntryRecord]:
        """Returns a manifest's entries in the order they were committed (empty if unknown)."""
        e = _sql.manifest_entries
        query = select(e).where(e.c.manifest_id == manifest_id).order_by(e.c.position)
        with self._read(f"read manifest {manifest_id}") as conn:
            return [_convert.entry(r) for r in conn.execute(query)]

    def snapshot_chunk_ids(self, snapshot_id: str) -> set[str]:
        """Returns the ids of the chunks a snapshot references."""
        sc = _sql.snapshot_chunks
        with self._read(f"read chunks of {snapshot_id}") as conn:
            return set(conn.scalars(select(sc.c.chunk_id).where(sc.c.snapshot_id == snapshot_id)))

    def stored_bytes(self, snapshot_id: str) -> int:
        """Returns the stored (compressed) size of the chunks a snapshot references."""
        sc, c = _sql.snapshot_chunks, _sql.chunks
        query = (
            select(func.coalesce(func.sum(c.c.length), 0))
            .select_from(sc.join(c, c.c.id == sc.c.chunk_id))
            .where(sc.c.snapshot_id == snapshot_id)
        )
        with self._read(f"size snapshot {snapshot_id}") as conn:
            return int(conn.scalar(query) or 0)

    def snapshot_ids(self, snapshot_ids: Iterable[str]) -> set[str]:
        """Those of ``snapshot_ids`` this index holds (a remote's, asked before eviction)."""
        s = _sql.snapshots
        found: set[str] = set()
        with self._read("find snapshots") as conn:
            for batch in batches(unique(snapshot_ids)):
                found.update(str(i) for i in conn.scalars(select(s.c.id).where(s.c.id.in_(batch))))
        return found

    def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """Pack id -> its recorded size in bytes, for the packs among ``pack_ids`` with a row
        (what eviction compares with the pack a remote holds)."""
        p = _sql.packs
        out: dict[str, int] = {}
        with self._read("read pack sizes") as conn:
            for batch in batches(unique(pack_ids)):
                out.update(
                    (str(i), int(n))
                    for i, n in conn.execute(select(p.c.id, p.c.size).where(p.c.id.in_(batch)))
                )
        return out

    def chunk_locations(self, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """Returns where each known chunk among ``chunk_ids`` lives (no pins; for reads).

        The result also holds the bases of every delta among them, down to the full chunk at
        the root of each chain (in one read transaction, so a chain is seen whole), which is
        everything a reader needs to decode them.
        """
        c = _sql.chunks
        found: dict[str, ChunkRecord] = {}
        with self._read("locate chunks") as conn:
            todo = unique(chunk_ids)
            for _ in range(MAX_CHAIN_ROUNDS):
                for batch in batches(todo):
                    found.update(
                        (r.id, _convert.chunk(r))
                        for r in conn.execute(select(c).where(c.c.id.in_(batch)))
                    )
                todo = unique(
                    r.base_id
                    for r in found.values()
                    if r.base_id is not None and r.base_id not in found
                )
                if not todo:
                    break
        return found
