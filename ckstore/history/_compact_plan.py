"""What a compaction rewrites and against which bases: its plan (index and manifests only).

1. **Jobs**: the loose chunks outside every run's newest ``keep_loose`` snapshots, in the order
   of the oldest snapshot that uses them (a snapshot gc drops while this plans is skipped).
   Each gets a *candidate* base: the chunk at the same place (key, dtype, shape, grid box) in
   that snapshot's parent, as a take with ``delta_base="parent"`` would use.
2. **Bases**: decided bases first, so every chunk's planned depth is known when a chunk that
   would use it is decided. The candidates form a graph in which a chunk may lead back to
   itself: takes into one run may commit out of the order they started in (many hosts), so a
   parent can be newer than its child, and two snapshots can each be the other's candidate
   source. A chunk whose candidate chain leads back to it gets no base (the chain is cut there),
   so no planned chain is ever a cycle. A candidate at the repository's ``delta_depth`` or
   deeper is replaced by its ancestor one link shallower (keyframes, as for takes). A chunk some
   stored delta already uses as its base stays whole (its dependents' chains must not grow).
   The bases chosen are pinned to the compaction's write session, so no gc prunes one
   meanwhile.

The jobs come back bases first: a chunk is rewritten, and its row switched, after the chunk it
is a delta against (the index refuses a delta against a chunk that would make a chain longer
than planned, :meth:`ckstore.index.Index.rewrite_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import objects
from ..errors import NotFoundError
from ..format.dtypes import GROUPED, itemsize
from ..format.manifest import Manifest, TensorEntry
from ..index import ChunkRecord, SnapshotRecord

if TYPE_CHECKING:
    from ..engine.interfaces import CompactIndex
    from ..engine.repository import Repository


@dataclass
class Job:
    """One loose chunk to rewrite: its row, its element size, its delta base (if any)."""

    rec: ChunkRecord
    itemsize: int
    grouped: bool
    base_id: str = ""
    base: ChunkRecord | None = None
    base_known: dict[str, ChunkRecord] = field(default_factory=dict)


# --- 1. jobs -------------------------------------------------------------------------------------
def hot(index: CompactIndex, keep_loose: int, young: AbstractSet[str] = frozenset()) -> set[str]:
    """Chunk ids of every run's newest ``keep_loose`` snapshots, and of the snapshots
    ``young`` names that still exist."""
    found: set[str] = set()
    for run in index.list_runs() if keep_loose > 0 else []:
        for rec in index.list_snapshots(run=run, limit=keep_loose):
            found |= index.snapshot_chunk_ids(rec.id)
    for sid in young:
        found |= index.snapshot_chunk_ids(sid)
    return found


def plan(
    repo: Repository, keep_loose: int, young: AbstractSet[str] = frozenset()
) -> tuple[list[Job], int]:
    """The loose chunks to rewrite, oldest snapshot first, with their base candidates; and the
    number of snapshots they come from (outside each run's newest ``keep_loose`` and the
    snapshots ``young`` names). A snapshot dropped meanwhile (gc in another process) is
    skipped: its chunks are either gone or come with another snapshot."""
    index: CompactIndex = repo.index
    loose = {c.chunk_id: c for c in index.loose_chunks() if c.codec in objects.FAST_CODECS}
    for cid in hot(index, keep_loose, young):
        loose.pop(cid, None)
    if not loose:
        return [], 0
    records = sorted(
        (r for r in map(_snapshot(index), index.referencing_snapshots(loose)) if r),
        key=lambda r: (r.created_at, r.id),
    )
    jobs: list[Job] = []
    snaps = 0
    for rec in records:
        manifest = _manifest(repo, rec)
        if manifest is None:
            continue
        parent = _parent_manifest(repo, rec)
        found = False
        for key, entry in manifest.entries.items():
            for job in _jobs_of(key, entry, parent, loose):
                jobs.append(job)
                found = True
        for cid in manifest.parts:  # a manifest's parts and nodes: JSON, no delta base
            row = loose.pop(cid, None)
            if row is not None:
                jobs.append(Job(row, 1, False))
                found = True
        snaps += found
    return jobs, snaps


def _snapshot(index: CompactIndex) -> Any:
    def get(snapshot_id: str) -> SnapshotRecord | None:
        try:
            return index.get_snapshot(snapshot_id)
        except NotFoundError:  # dropped by a gc since the query: nothing to rewrite for it
            return None

    return get


def _manifest(repo: Repository, rec: SnapshotRecord) -> Manifest | None:
    """The snapshot's manifest; None if a gc removed it (with the snapshot) meanwhile."""
    index: CompactIndex = repo.index
    try:
        return repo.load_manifest(rec)
    except NotFoundError:
        try:
            index.get_snapshot(rec.id)
        except NotFoundError:
            return None
        raise  # the snapshot is there and its manifest is not: check names that


def _parent_manifest(repo: Repository, rec: SnapshotRecord) -> Manifest | None:
    index: CompactIndex = repo.index
    if rec.parent_id is None or repo.delta_depth == 0:
        return None
    try:
        return repo.load_manifest(index.get_snapshot(rec.parent_id))
    except Exception:  # noqa: BLE001 - a parent gone or unreadable: no deltas for this snapshot
        return None


def _jobs_of(
    key: str, entry: Any, parent: Manifest | None, loose: dict[str, ChunkRecord]
) -> Iterator[Job]:
    """Jobs for the loose chunks of one entry (each chunk once: ``loose`` loses them)."""
    if not isinstance(entry, TensorEntry) or entry.inline:
        return
    size = itemsize(entry.dtype)
    old = parent.entries.get(key) if parent is not None else None
    at: dict[tuple[Any, Any], str] = {}
    if (
        isinstance(old, TensorEntry)
        and not old.inline
        and (old.dtype, old.shape) == (entry.dtype, entry.shape)
    ):
        at = {(c.offsets, c.sizes): c.id for c in old.chunks}
    for c in entry.chunks:
        rec = loose.pop(c.id, None)
        if rec is not None:
            base = at.get((c.offsets, c.sizes), "")
            yield Job(rec, size, entry.dtype in GROUPED, base if base != c.id else "")


# --- 2. bases ------------------------------------------------------------------------------------
def resolve_bases(repo: Repository, session: str, jobs: list[Job]) -> list[Job]:
    """Choose and pin each job's base (module docstring); the others get none. Returns the jobs
    bases first (each after the job of its base)."""
    index: CompactIndex = repo.index
    limit = repo.delta_depth
    if limit <= 0 or not any(j.base_id for j in jobs):
        for j in jobs:
            j.base_id = ""
        return jobs
    keep_whole = index.dependents_of({j.rec.chunk_id for j in jobs})
    known = index.chunk_locations({j.base_id for j in jobs if j.base_id})
    chooser = _Chooser(limit, known, keep_whole)
    ordered = [
        j for job in jobs for j in _bases_first(job, {x.rec.chunk_id: x for x in jobs}, chooser)
    ]
    pinned = index.lookup_chunks(session, list(chooser.wanted))  # gone meanwhile: no delta
    for j in ordered:
        if j.base_id and j.base_id in pinned:
            rec = chooser.wanted[j.base_id]
            j.base = replace(rec, depth=chooser.depth.get(j.base_id, rec.depth))
            j.base_known = known
        else:
            j.base_id = ""
    return ordered


class _Chooser:
    """Decides bases one chunk at a time, bases first, keeping the planned depths and links."""

    def __init__(self, limit: int, known: dict[str, ChunkRecord], keep_whole: set[str]) -> None:
        self.limit, self.known, self.keep_whole = limit, known, keep_whole
        self.depth: dict[str, int] = {}  # planned depth of each decided job's chunk
        self.parent: dict[str, str] = {}  # planned base of each decided job's chunk
        self.wanted: dict[str, ChunkRecord] = {}
        self.decided: set[str] = set()

    def decide(self, job: Job, cut: bool = False) -> None:
        """Give ``job`` its base (none with ``cut``: its candidate chain leads back to it)."""
        cid = job.rec.chunk_id
        self.decided.add(cid)
        base = (
            "" if cut else usable_base(job.base_id, self.limit, self.depth, self.parent, self.known)
        )
        rec = self.known.get(base) if base else None
        if (
            cid in self.keep_whole
            or rec is None
            or rec.raw_length != job.rec.raw_length
            or self.leads_to(base, cid)
        ):
            job.base_id, self.depth[cid] = "", 0
            return
        job.base_id = base
        self.depth[cid], self.parent[cid] = self.depth.get(base, rec.depth) + 1, base
        self.wanted[base] = rec

    def leads_to(self, start: str, target: str) -> bool:
        """Whether the planned (else stored) chain from ``start`` reaches ``target``."""
        cid, seen = start, set()
        while cid and cid not in seen:
            if cid == target:
                return True
            seen.add(cid)
            rec = self.known.get(cid)
            cid = self.parent.get(cid) or (rec.base_id if rec is not None and rec.base_id else "")
        return bool(cid)  # a loop among stored rows: never build on it


def _bases_first(job: Job, jobs: dict[str, Job], chooser: _Chooser) -> list[Job]:
    """Decide ``job`` after the jobs its candidate chain goes through; the jobs decided, in
    order. A chain that comes back to a job on it is cut there (that job gets no base)."""
    path: list[Job] = []
    on_path: set[str] = set()
    cur: Job | None = job
    cut: Job | None = None
    while cur is not None and cur.rec.chunk_id not in chooser.decided:
        if cur.rec.chunk_id in on_path:
            cut = cur
            break
        path.append(cur)
        on_path.add(cur.rec.chunk_id)
        cur = jobs.get(cur.base_id) if cur.base_id else None
    out: list[Job] = []
    if cut is not None:
        chooser.decide(cut, cut=True)
        out.append(cut)
    for j in reversed(path):
        if j is not cut:
            chooser.decide(j)
            out.append(j)
    return out


def usable_base(
    cid: str,
    limit: int,
    depth: dict[str, int],
    parent: dict[str, str],
    known: dict[str, ChunkRecord],
) -> str:
    """``cid``, or its nearest ancestor whose (planned) depth is below ``limit``; "" if none."""
    for _ in range(limit + 1):
        if not cid:
            return ""
        rec = known.get(cid)
        d = depth.get(cid, rec.depth if rec is not None else None)
        if d is None:
            return ""
        if d < limit:
            return cid
        cid = parent.get(cid) or (rec.base_id if rec is not None and rec.base_id else "")
    return ""
