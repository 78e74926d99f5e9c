"""Index queries for disk usage (a part of :class:`~ckstore.index.index.Index`): what each run
and the whole store reference, counted from the references alone (``ckstore du``).

Logical bytes are the sum of the snapshots' logical sizes. Stored bytes count each chunk once,
at its stored (compressed) length: per run, the unique chunks its snapshots reference;
store-wide, the unique chunks of every snapshot. A run's *exclusive* bytes are the stored bytes
of the chunks only that run references; a chunk that a delta of another run (or a chunk no
snapshot references) is stored against is not exclusive, since deleting the run leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from ckstore.index import _sql
from ckstore.index.base import IndexBase


@dataclass(frozen=True)
class Usage:
    """What a run's snapshots (or every snapshot, ``run`` None) reference.

    Attributes:
        run: Run name, or None for the whole store.
        snapshots: Number of snapshots.
        logical_bytes: Sum of their logical sizes.
        stored_bytes: Stored length of the unique chunks they reference.
        chunks: Number of those unique chunks.
        delta_chunks: Of those chunks, how many are stored as deltas...
        delta_raw_bytes: ...their raw size...
        delta_bytes: ...and their stored length (included in ``stored_bytes``).
        remote_bytes: Whole store only: the stored length of those chunks whose rows point at
            a remote's pack (a two-tier store evicted them from this disk; included in
            ``stored_bytes``).
    """

    run: str | None
    snapshots: int
    logical_bytes: int
    stored_bytes: int
    chunks: int
    delta_chunks: int = 0
    delta_raw_bytes: int = 0
    delta_bytes: int = 0
    remote_bytes: int = 0


@dataclass(frozen=True)
class StoreUsage:
    """Usage per run and for the whole store, read in one transaction.

    Attributes:
        runs: One :class:`Usage` per run, in run-name order.
        total: The whole store's (``run`` None).
        exclusive: Run -> stored bytes of the chunks only that run needs (runs with none
            are left out).
    """

    runs: list[Usage]
    total: Usage
    exclusive: dict[str, int]


class DiskUsage(IndexBase):
    """Disk usage queries. Every one is read-only."""

    def usage(self) -> StoreUsage:
        """Usage per run, for the whole store, and each run's exclusive bytes (one snapshot of
        the index: the three agree). Cost: a scan of the chunk references."""
        with self._read("disk usage") as conn:
            return StoreUsage(_run_rows(conn), _total_row(conn), _exclusive(conn))

    def exclusive_by_run(self) -> dict[str, int]:
        """Run -> stored bytes of the chunks only that run needs: what deleting the run and a
        ``gc`` free (runs with none are left out)."""
        with self._read("disk usage by run") as conn:
            return _exclusive(conn)


def _run_rows(conn: Connection) -> list[Usage]:
    s, sc, c = _sql.snapshots, _sql.snapshot_chunks, _sql.chunks
    counts = conn.execute(
        select(s.c.run, func.count(), func.coalesce(func.sum(s.c.logical_bytes), 0)).group_by(
            s.c.run
        )
    ).all()
    pairs = select(s.c.run, sc.c.chunk_id).select_from(sc.join(s, s.c.id == sc.c.snapshot_id))
    pairs_q = pairs.distinct().subquery()
    stored = {
        r.run: (int(r.bytes), int(r.n))
        for r in conn.execute(
            select(
                pairs_q.c.run,
                func.coalesce(func.sum(c.c.length), 0).label("bytes"),
                func.count().label("n"),
            )
            .select_from(pairs_q.join(c, c.c.id == pairs_q.c.chunk_id))
            .group_by(pairs_q.c.run)
        )
    }
    deltas = {
        r[0]: (int(r[1]), int(r[2]), int(r[3]))
        for r in conn.execute(
            select(pairs_q.c.run, *_delta_sums(c))
            .select_from(pairs_q.join(c, c.c.id == pairs_q.c.chunk_id))
            .where(c.c.base_id.is_not(None))
            .group_by(pairs_q.c.run)
        )
    }
    return [
        Usage(str(run), int(n), int(logical), *stored.get(run, (0, 0)), *deltas.get(run, (0, 0, 0)))
        for run, n, logical in sorted(counts, key=lambda r: r[0])
    ]


def _delta_sums(c: Any) -> tuple[Any, ...]:
    """Count, raw bytes and stored bytes of the delta chunks among the selected rows."""
    return (
        func.count(),
        func.coalesce(func.sum(c.c.raw_length), 0),
        func.coalesce(func.sum(c.c.length), 0),
    )


def _total_row(conn: Connection) -> Usage:
    s, sc, c = _sql.snapshots, _sql.snapshot_chunks, _sql.chunks
    n, logical = conn.execute(
        select(func.count(), func.coalesce(func.sum(s.c.logical_bytes), 0))
    ).one()
    used = select(sc.c.chunk_id).distinct().subquery()
    stored, chunks = conn.execute(
        select(func.coalesce(func.sum(c.c.length), 0), func.count()).select_from(
            used.join(c, c.c.id == used.c.chunk_id)
        )
    ).one()
    deltas = conn.execute(
        select(*_delta_sums(c))
        .select_from(used.join(c, c.c.id == used.c.chunk_id))
        .where(c.c.base_id.is_not(None))
    ).one()
    p = _sql.packs
    remote = conn.scalar(
        select(func.coalesce(func.sum(c.c.length), 0))
        .select_from(used.join(c, c.c.id == used.c.chunk_id).join(p, p.c.id == c.c.pack_id))
        .where(p.c.remote.is_not(None))
    )
    delta_chunks, delta_raw, delta_stored = (int(v) for v in deltas)
    return Usage(
        None,
        int(n),
        int(logical),
        int(stored),
        int(chunks),
        delta_chunks,
        delta_raw,
        delta_stored,
        remote_bytes=int(remote or 0),
    )


def _exclusive(conn: Connection) -> dict[str, int]:
    s, sc, c = _sql.snapshots, _sql.snapshot_chunks, _sql.chunks
    pairs = (
        select(s.c.run, sc.c.chunk_id)
        .select_from(sc.join(s, s.c.id == sc.c.snapshot_id))
        .distinct()
        .subquery()
    )
    owners = (
        select(pairs.c.chunk_id, func.count().label("n"), func.min(pairs.c.run).label("run"))
        .group_by(pairs.c.chunk_id)
        .subquery()
    )
    rows = conn.execute(
        select(owners.c.run, c.c.id, c.c.length)
        .select_from(owners.join(c, c.c.id == owners.c.chunk_id))
        .where(owners.c.n == 1)
    ).all()
    owner = {str(r[1]): str(r[0]) for r in rows}
    edges = [
        (str(d), str(b))
        for d, b in conn.execute(select(c.c.id, c.c.base_id).where(c.c.base_id.is_not(None)))
    ]
    changed = True
    while changed:  # a base stays while a delta that stays needs it (another run's, or nobody's)
        changed = False
        for delta, base in edges:
            run = owner.get(base)
            if run is not None and owner.get(delta) != run:
                del owner[base]
                changed = True
    out: dict[str, int] = {}
    for run, chunk, length in rows:
        if owner.get(str(chunk)) is not None:
            out[str(run)] = out.get(str(run), 0) + int(length)
    return out
