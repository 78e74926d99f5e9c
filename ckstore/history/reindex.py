"""Rebuild the SQL index from the store alone (reliability contract I5).

Packs describe themselves (their trailers list every chunk), and every manifest carries its
snapshot header (run, step, time, metadata, name; and for a distributed take ``world_size`` and
each rank's write figures, in its parts when it is stored in parts), so an empty index can be
refilled from the objects: chunk rows from pack trailers, then one commit per manifest in time
order (which re-derives each run's parent chain; a manifest stored in parts is assembled from
its parts, which are chunks, so they are indexed by then). A manifest whose chunks are not all present, or whose header is malformed, is skipped
and reported. Tags are refs kept only in the index and are not recovered.

What a rebuilt snapshot row cannot know: how many bytes and chunks its take wrote rather than
found already stored (``new_bytes``, ``new_chunks``) depends on what the store held at that
moment, which the objects do not record. A distributed take's header keeps each rank's figures
(``ranks``), so those rows get the sums back exactly as committed; any other row gets 0 for
both, and ``reused_chunks`` counts every chunk the manifest references.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine import manifests
from ..engine.lease import Lease
from ..engine.locations import to_records
from ..engine.take.commit import entry_records
from ..errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    ObjectNotFoundError,
    StorageError,
)
from ..format.health import summary as health_summary
from ..format.manifest import Manifest, PerRankEntry
from ..index import PackRecord, SnapshotRecord
from ..objects.delta import MAX_CHAIN

if TYPE_CHECKING:
    from ..engine.interfaces import ReindexIndex
    from ..engine.repository import Repository


@dataclass
class ReindexReport:
    """What a reindex recovered and what it could not."""

    packs: int = 0
    chunks: int = 0
    snapshots: int = 0
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reindex(repo: Repository) -> ReindexReport:
    """Refill ``store``'s (empty) index from its packs and manifests.

    Raises:
        ConflictError: the index already records snapshots (reindex into a fresh index).
        StorageError: a pack or manifest could not be read for a reason other than damage (a
            timeout, a refused request): nothing is committed then, and a second run may
            follow. A damaged object (or one gone since it was listed) is skipped and reported.
    """
    index: ReindexIndex = repo.index
    if index.list_snapshots(limit=1):
        raise ConflictError(
            f"index {index.url} already holds snapshots; reindex rebuilds an EMPTY index "
            "(move the old index file away, or pass another --index URL)"
        )
    report = ReindexReport()
    with Lease(index, repo.lease_seconds) as lease:
        known = _add_packs(repo, lease.id, report)
        for manifest_id, manifest, size in _manifests_by_time(repo, report):
            _commit(repo, manifest_id, manifest, size, known, report)
    return report


def _add_packs(repo: Repository, session: str, report: ReindexReport) -> set[str]:
    """Index every readable pack's chunks; return the ids of the chunks indexed.

    A chunk stored in several packs is indexed at one place, a full copy when there is one.
    Deltas get their chain depth from their bases and are indexed after them (the index
    refuses a delta whose base it lacks); a delta whose chain does not reach a full chunk in
    some pack is left out and reported.
    """
    index: ReindexIndex = repo.index
    packs: dict[str, int] = {}
    chosen: dict[str, objects.ChunkLocation] = {}
    for pack_id in repo.objects.list_packs():
        try:
            locs = objects.read_pack_index(repo.objects.backend, pack_id)
        except (CorruptionError, ObjectNotFoundError) as exc:  # damaged, or gone since listed
            report.skipped.append(f"pack {pack_id}: {exc}")
            continue
        except CkstoreError as exc:
            raise _stopped(f"pack {pack_id}", exc) from exc
        packs[pack_id] = len(locs)
        for loc in locs:
            have = chosen.get(loc.chunk_id)
            if have is None or (have.base_id is not None and loc.base_id is None):
                chosen[loc.chunk_id] = loc
    depths = _depths(chosen, report)
    by_pack: dict[str, list[objects.ChunkLocation]] = {p: [] for p in packs}
    for cid, loc in chosen.items():
        if cid in depths:
            by_pack[loc.pack_id].append(loc)
    for level in range(max(depths.values(), default=0) + 1):
        for pack_id, locs in by_pack.items():
            rows = to_records([l for l in locs if depths[l.chunk_id] == level], depths)
            if rows or level == 0:
                index.add_pack(
                    session,
                    PackRecord(pack_id, repo.objects.pack_size(pack_id), packs[pack_id]),
                    rows,
                )
    report.packs += len(packs)
    report.chunks += len(depths)
    return set(depths)


def _stopped(what: str, exc: CkstoreError) -> StorageError:
    """The error a reindex stops with when storage fails (not a damaged object): skipping it
    would leave the object out of the index, and the next gc would delete it as an orphan."""
    return StorageError(
        f"reindex stopped: {what} could not be read ({type(exc).__name__}: {exc}). Nothing was "
        "lost and no snapshot is recorded yet: run `ckstore reindex` again once the storage "
        "answers (do not run gc on this store before it succeeds)"
    )


def _depths(chosen: dict[str, objects.ChunkLocation], report: ReindexReport) -> dict[str, int]:
    """Each chunk's chain depth (0 for a full chunk); deltas without a full root within
    ``MAX_CHAIN`` links are left out."""
    depths: dict[str, int] = {}
    for cid in chosen:
        path: list[str] = []
        at: str | None = cid
        while at is not None and at not in depths:
            loc = chosen.get(at)
            if loc is None or at in path or len(path) > MAX_CHAIN:
                report.skipped.append(
                    f"chunk {cid}: its delta chain does not reach a full chunk ({at} is missing or a loop)"
                )
                break
            path.append(at)
            at = loc.base_id
        else:
            base = -1 if at is None else depths[at]
            for i, link in enumerate(reversed(path)):
                if base + 1 + i <= MAX_CHAIN:  # readers refuse a deeper chain
                    depths[link] = base + 1 + i
            if cid not in depths:
                report.skipped.append(
                    f"chunk {cid}: its delta chain is longer than {MAX_CHAIN} links"
                )
    return depths


def _manifests_by_time(repo: Repository, report: ReindexReport) -> list[tuple[str, Manifest, int]]:
    """Every readable manifest with a header, oldest first, with its object's size. One stored
    in parts is assembled from its parts and nodes, chunks whose rows are rebuilt by now."""
    found = []
    for manifest_id in repo.objects.list_blobs("manifests"):
        try:
            raw = repo.objects.get_blob("manifests", manifest_id)
            manifest = manifests.load(repo.objects, repo.index, raw, f"manifest {manifest_id}")
        except (CorruptionError, ObjectNotFoundError) as exc:
            report.skipped.append(f"manifest {manifest_id}: {exc}")
            continue
        except CkstoreError as exc:
            raise _stopped(f"manifest {manifest_id}", exc) from exc
        if manifest.snapshot is None:
            report.skipped.append(f"manifest {manifest_id}: no snapshot header")
            continue
        found.append((manifest_id, manifest, len(raw)))
    return sorted(found, key=lambda m: (float(m[1].snapshot.get("created_at", 0.0)), m[0]))  # type: ignore[union-attr]


def _commit(
    repo: Repository,
    manifest_id: str,
    manifest: Manifest,
    size: int,
    known: set[str],
    report: ReindexReport,
) -> None:
    index: ReindexIndex = repo.index
    header = manifest.snapshot or {}
    needed = manifest.referenced_ids()
    if not needed <= known:
        report.skipped.append(
            f"manifest {manifest_id}: {len(needed - known)} chunk(s) missing from the packs"
        )
        return
    try:
        world, counts = _take_figures(manifest, len(needed))
    except CorruptionError as exc:
        report.skipped.append(f"manifest {manifest_id}: {exc}")
        return
    summary = health_summary(
        header
    )  # what the take found is in the header: the index keeps it again
    record = SnapshotRecord(
        id=manifest_id,
        run=str(header.get("run", "default")),
        step=header.get("step"),
        parent_id=None,
        manifest_id=manifest_id,
        created_at=float(header.get("created_at", 0.0)),
        metadata=dict(header.get("metadata") or {}),
        logical_bytes=manifest.logical_bytes(),
        new_bytes=counts["new_bytes"],
        new_chunks=counts["new_chunks"],
        reused_chunks=counts["reused_chunks"],
        name=header.get("name"),
        world_size=world,
        nonfinite=summary[0],
        stale=summary[1],
        diverged=summary[2],
    )
    # commit_snapshot ends the session it commits under: give each snapshot its own session.
    with Lease(index, repo.lease_seconds) as one:
        index.lookup_chunks(one.id, needed)
        index.commit_snapshot(one.id, record, entry_records(manifest), needed, size, ())
        one.committed = True
    report.snapshots += 1


_COUNTS = ("new_bytes", "new_chunks", "reused_chunks")


def _take_figures(manifest: Manifest, referenced: int) -> tuple[int, dict[str, int]]:
    """The world size and write figures the header records (see the module docstring).

    Raises:
        CorruptionError: ``world_size`` is not a positive int, ``ranks`` is not one dict of
            non-negative int figures per rank, or a per-rank entry has another rank count.
    """
    header = manifest.snapshot or {}
    world = header.get("world_size", 1)
    if type(world) is not int or world < 1:
        raise CorruptionError(
            f"snapshot header has world_size {str(world)[:40]!r}; expected an int >= 1"
        )
    per_rank = {e.world_size for e in manifest.entries.values() if isinstance(e, PerRankEntry)}
    if per_rank - {world}:
        raise CorruptionError(
            f"per-rank entries hold {sorted(per_rank)} ranks; the header says world_size {world}"
        )
    ranks = header.get("ranks")
    if ranks is None:
        return world, {"new_bytes": 0, "new_chunks": 0, "reused_chunks": referenced}
    ok = (
        type(ranks) is list
        and len(ranks) == world
        and all(type(r) is dict and all(_count(r.get(k)) for k in _COUNTS) for r in ranks)
    )
    if not ok:
        raise CorruptionError(
            f"snapshot header's ranks is not one record of {list(_COUNTS)} (ints >= 0) per rank "
            f"for world_size {world}"
        )
    return world, {k: sum(r[k] for r in ranks) for k in _COUNTS}


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0
