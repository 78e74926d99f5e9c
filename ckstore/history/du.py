"""Disk usage: logical versus stored bytes per run, and for the whole store.

Logical bytes are what the snapshots would take as full copies (the sum of their tensors' sizes).
Stored bytes count each chunk once, at its stored (compressed) length: per run, the unique chunks
its snapshots reference; store-wide, the unique chunks of every snapshot. The ratio logical /
stored is the saving from dedup and compression together. Pack bytes on the backend also hold
chunks no snapshot references any more (reclaimed by ``gc``) and pack headers.

A run's *exclusive* bytes are the stored bytes of the chunks only that run references (shared
ones are counted by no run): what deleting the run (``ckstore rm --run``) and a ``gc`` free.
A chunk that a delta of another run is stored against stays, so it is not exclusive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from ..index import models

if TYPE_CHECKING:
    from ..engine.repository import Repository

_snapshots = models.snapshots
_snapshot_chunks = models.snapshot_chunks
_chunks = models.chunks
_packs = models.packs


@dataclass(frozen=True)
class UsageRow:
    """Usage of one run (``run`` is None on the store-wide total row).

    Attributes:
        run: Run name, or None for the total.
        snapshots: Number of snapshots.
        logical_bytes: Sum of the snapshots' logical sizes.
        stored_bytes: Stored length of the unique chunks they reference.
        chunks: Number of those unique chunks.
        pack_bytes: Total row only: bytes of every pack object on the backend.
        packs: Total row only: number of pack objects on the backend.
        delta_chunks: Of the unique chunks, how many are stored as deltas...
        delta_raw_bytes: ...their raw size...
        delta_bytes: ...and their stored length (included in ``stored_bytes``). The bases they
            need are counted where they are referenced (a base model's run, an older snapshot).
        exclusive_bytes: Per run: stored bytes of the chunks no other run needs (what
            deleting the run frees); None on the total row.
    """

    run: str | None
    snapshots: int
    logical_bytes: int
    stored_bytes: int
    chunks: int
    pack_bytes: int | None = None
    packs: int | None = None
    delta_chunks: int = 0
    delta_raw_bytes: int = 0
    delta_bytes: int = 0
    exclusive_bytes: int | None = None

    @property
    def delta_saved_bytes(self) -> int:
        """Raw bytes of the delta chunks that their deltas did not store."""
        return self.delta_raw_bytes - self.delta_bytes

    @property
    def dedup_ratio(self) -> float | None:
        """logical / stored; None when nothing is stored."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "run": self.run,
            "snapshots": self.snapshots,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "chunks": self.chunks,
            "dedup_ratio": self.dedup_ratio,
            "delta_chunks": self.delta_chunks,
            "delta_raw_bytes": self.delta_raw_bytes,
            "delta_bytes": self.delta_bytes,
        }
        if self.run is not None:
            d["exclusive_bytes"] = self.exclusive_bytes
        else:
            d.update(pack_bytes=self.pack_bytes, packs=self.packs)
        return d


def du(
    repo: Repository, progress: Callable[[Iterable[str]], Iterable[str]] | None = None
) -> list[UsageRow]:
    """Per-run usage rows in run order, then one store-wide total row (``run=None``).

    Args:
        store: The store.
        progress: Optional wrapper around the pack iteration (e.g. a progress bar).
    """
    with repo.index._read("disk usage") as conn:
        rows = _run_rows(conn)
        total = _total_row(conn)
        only = _exclusive(conn)
    rows = [replace(r, exclusive_bytes=only.get(r.run or "", 0)) for r in rows]
    pack_ids = repo.objects.list_packs()
    sizes = (repo.objects.pack_size(p) for p in (progress(pack_ids) if progress else pack_ids))
    pack_bytes = sum(sizes)
    n, logical, stored, chunks, *deltas = total
    return [*rows, UsageRow(None, n, logical, stored, chunks, pack_bytes, len(pack_ids), *deltas)]


def _run_rows(conn: Connection) -> list[UsageRow]:
    s, sc, c = _snapshots, _snapshot_chunks, _chunks
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
        UsageRow(
            run,
            int(n),
            int(logical),
            *stored.get(run, (0, 0)),
            None,
            None,
            *deltas.get(run, (0, 0, 0)),
        )
        for run, n, logical in sorted(counts, key=lambda r: r[0])
    ]


def _delta_sums(c: Any) -> tuple[Any, ...]:
    """Count, raw bytes and stored bytes of the delta chunks among the selected rows."""
    return (
        func.count(),
        func.coalesce(func.sum(c.c.raw_length), 0),
        func.coalesce(func.sum(c.c.length), 0),
    )


def _total_row(conn: Connection) -> tuple[int, ...]:
    s, sc, c = _snapshots, _snapshot_chunks, _chunks
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
    return int(n), int(logical), int(stored), int(chunks), *(int(v) for v in deltas)


def exclusive_bytes(repo: Repository) -> dict[str, int]:
    """Run -> stored bytes of the chunks only that run needs (see the module docstring)."""
    with repo.index._read("disk usage by run") as conn:
        return _exclusive(conn)


def _exclusive(conn: Connection) -> dict[str, int]:
    s, sc, c = _snapshots, _snapshot_chunks, _chunks
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
