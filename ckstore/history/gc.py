"""Garbage collection that is safe beside live writers (reliability contract I4).

Two phases, as restic's forget + prune:

1. **forget** — drop the snapshot rows a retention :class:`Policy` selects.
2. **prune** — expire stale write sessions (their pins go; also, at once, the sessions of
   processes known to be gone: of this host, same PID namespace and boot, no such pid any
   more, :func:`ckstore.engine.lease.gone`), delete chunk rows that nothing
   references or pins and that are older than the grace period, retire packs left without live
   chunks, rewrite packs whose live fraction fell below ``repack_below`` (new pack first, index
   switched, old pack retired), delete retired packs' rows and then objects once the grace
   period has passed, drop unused manifests, and delete orphan objects (in the store, unknown
   to the index) only when no write session that could own them is still alive; last, give
   back the disk the index's write-ahead log holds (SQLite).

Index rows always go before objects. A take that stalls past its lease loses its pins here and
then fails at commit; it never commits references to chunks this GC deleted.

The report also says what the grace period kept: unreferenced chunks younger than it and
retired packs not yet past it, their bytes, and when the grace period of the youngest ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine.lease import Lease, gone
from ..engine.locations import to_location, to_records
from ..engine.progress import ProgressFn, meter
from ..errors import ConflictError, CorruptionError, ObjectNotFoundError, SnapshotNotFoundError
from ..format.limits import check_number
from ..index import ChunkRecord, PackRecord
from ..objects.delta import xor_into
from ._gc_plan import predict, sparse
from .defaults import DEFAULT_GRACE_SECONDS as DEFAULT_GRACE_SECONDS
from .defaults import DEFAULT_REPACK_BELOW as DEFAULT_REPACK_BELOW
from .policy import MAX_SECONDS, Policy, heads_of

if TYPE_CHECKING:
    from ..engine.interfaces import GcIndex
    from ..engine.repository import Repository


@dataclass
class GCReport:
    """What a gc did (or, with ``dry_run``, would do)."""

    dry_run: bool
    snapshots_dropped: list[str] = field(default_factory=list)
    snapshots_kept: int = 0
    snapshots_kept_unpushed: int = 0
    """Snapshots the policy would drop that a persistent tier does not hold yet (kept until it does)."""
    sessions_expired: int = 0
    chunks_removed: int = 0
    chunk_bytes_removed: int = 0
    packs_rewritten: int = 0
    packs_retired: int = 0
    packs_removed: int = 0
    manifests_removed: int = 0
    orphans_removed: int = 0
    uploads_aborted: int = 0
    """Unfinished multipart uploads (S3) of writers that died mid-put, aborted with the orphans."""
    bytes_reclaimed: int = 0
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    grace_kept_chunks: int = 0
    """Unreferenced chunks kept because they are younger than the grace period."""
    grace_kept_packs: int = 0
    """Retired packs (no live chunk) kept until the grace period since retiring them ends."""
    grace_kept_bytes: int = 0
    """Stored bytes of both: what the grace period keeps from being reclaimed."""
    grace_expires_at: float | None = None
    """When the grace period of the youngest of them ends (Unix time; None: nothing kept).
    A gc after it prunes those chunks and deletes those packs; a pack that the pruning empties
    is retired then and deleted one grace period later (a reader may still be using it)."""
    purged_now: int = 0
    """Chunks of snapshots this store handle deleted that were reclaimed without waiting for
    the grace period (nothing else held a write session), with the packs they emptied."""
    sessions_held: list[dict[str, Any]] = field(default_factory=list)
    """Write sessions still active after this gc (``HeldSession.to_dict``): a take running,
    or one killed before it could end its lease, whose bytes gc leaves until the lease ends."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    repo: Repository,
    *,
    keep_last: int | None = None,
    keep_every_steps: int | None = None,
    keep_tagged: bool = True,
    older_than: float | None = None,
    runs: list[str] | tuple[str, ...] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    repack_below: float = DEFAULT_REPACK_BELOW,
    dry_run: bool = False,
    keep_healthy: bool = True,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    progress: ProgressFn | None = None,
    purged: frozenset[str] = frozenset(),
    keep: Collection[str] = (),
    unshown: Callable[[list[str]], set[str]] | None = None,
) -> GCReport:
    """Forget the snapshots the policy drops, then prune what nothing references.

    Args:
        keep_last, keep_every_steps, keep_tagged, older_than, runs, keep_healthy, keep_best,
            metric, mode: the retention policy (see :class:`ckstore.history.policy.Policy`);
            with none of ``keep_last``, ``keep_every_steps``, ``older_than``, ``keep_best`` set
            only prune.
        keep: ids of snapshots kept whatever the policy says, as those no tier remote holds yet
            are: those a tier remote is recorded to hold but was not shown to hold now (the
            caller asks the remote; ``snapshots_kept_unpushed`` counts both).
        unshown: of the ids of the snapshots the policy drops, those a tier remote is recorded
            to hold but whose copy there was not shown whole (kept, counted as ``keep``).
        grace_seconds: unreferenced data younger than this, and retired packs retired more
            recently than this, are kept (readers that resolved a location just before may still
            be reading it).
        repack_below: rewrite packs whose live bytes fell below this fraction (0 disables).
        progress: told ``("gc", done, total)``, the live bytes of the sparse packs rewritten.
        dry_run: report without changing anything.
        purged: chunk ids of snapshots the caller deleted itself (a training job's purge).
            When no write session is alive, those nothing references or pins are pruned
            whatever their age, sparse packs are rewritten whatever their age, and the packs
            this gc retires are deleted at once: the grace period is for writers of other
            processes, and none is alive; a reader that looked up a chunk that moved looks it
            up again (docs/RELIABILITY.md, I4).

    Raises:
        InvalidInputError: an option is out of range (a negative or non-finite grace period,
            ``repack_below`` outside [0, 1], a negative ``keep_last``...), before anything
            changes.
    """
    index: GcIndex = repo.index
    repo.write_backs.wait()  # healed chunks land before anything judges the packs
    grace_seconds = check_number("gc: grace_seconds", grace_seconds, 0.0, MAX_SECONDS)
    repack_below = check_number("gc: repack_below", repack_below, 0.0, 1.0)
    policy = Policy(
        keep_last,
        keep_every_steps,
        keep_tagged,
        older_than,
        tuple(runs) if runs else None,
        keep_healthy,
        keep_best,
        metric,
        mode,
    )
    report = GCReport(dry_run=dry_run, grace_seconds=grace_seconds)
    now = time.time()
    cutoff = now - grace_seconds
    dropped = _forget(repo, policy, report, dry_run, set(keep), unshown)
    if dry_run:  # the same rules on the same rows, nothing written (history/_gc_plan.py)
        found = predict(repo, now, grace_seconds, dropped, repack_below)
        for name, value in asdict(found).items():
            if name != "staying":
                setattr(report, name, value)
        _grace_kept(repo, report, cutoff, dropped, found.staying)
        report.sessions_held = [h.to_dict(now) for h in index.held_sessions()]
        return report
    dead = [s.id for s in index.live_sessions() if gone(s.owner)]
    report.sessions_expired = index.expire_sessions(now, gone=dead)
    report.sessions_held = [h.to_dict(now) for h in index.held_sessions()]
    removed = index.prune_chunks(cutoff)
    emptied = _prune_purged(repo, report, purged)
    removed += emptied
    report.chunks_removed = len(removed)
    report.chunk_bytes_removed = sum(c.length for c in removed)
    now_too = bool(emptied)  # a purge ran: nothing else writes, so no pack needs to wait
    retired = _repack_sparse(repo, report, cutoff, repack_below, progress, any_age=now_too)
    if now_too:
        _delete_retired(repo, report, time.time(), only=retired)
    _delete_retired(repo, report, time.time() - grace_seconds)
    report.manifests_removed += _delete_manifests(repo, index.prune_manifests(cutoff))
    _delete_orphans(repo, report, cutoff)
    index.shrink_log()
    _grace_kept(repo, report, time.time() - grace_seconds, [])
    return report


def _forget(
    repo: Repository,
    policy: Policy,
    report: GCReport,
    dry_run: bool,
    keep: set[str],
    unshown: Callable[[list[str]], set[str]] | None,
) -> list[str]:
    index: GcIndex = repo.index
    snapshots = index.list_snapshots()
    tagged = {t.snapshot_id for t in index.list_tags()}
    unpushed = index.unpushed_to_tiers() | keep  # never what only this store has for sure
    heads = heads_of(index, {s.run for s in snapshots})
    selected = policy.select(snapshots, tagged, heads=heads)
    drop = [s for s in selected if s.id not in unpushed]
    if drop and unshown is not None:  # a tier remote's copy, whole before it is the only one
        kept = unshown([s.id for s in drop])
        drop = [s for s in drop if s.id not in kept]
    report.snapshots_kept_unpushed = len(selected) - len(drop)
    report.snapshots_kept = len(snapshots) - len(drop)
    gone_already: set[str] = set()
    for s in drop:
        if not dry_run:
            try:  # a tag set since the list above is seen here, or waits for the delete
                index.delete_snapshot(s.id, refuse_tagged=policy.keep_tagged)
            except SnapshotNotFoundError:  # another gc (or a delete) took it meanwhile
                gone_already.add(s.id)
                continue
            except ConflictError:  # tagged meanwhile: kept, as the policy keeps tagged ones
                gone_already.add(s.id)
                report.snapshots_kept += 1
                continue
        report.snapshots_dropped.append(
            f"{s.run}@{s.step}" if s.step is not None else f"{s.run} {s.id[:12]}"
        )
    drop = [s for s in drop if s.id not in gone_already]
    if not dry_run:  # the job's retention, as compaction after takes reads it
        repo.deletion_ages.deleted(s.id for s in drop)
    return [s.id for s in drop]


def _prune_purged(repo: Repository, report: GCReport, purged: frozenset[str]) -> list[ChunkRecord]:
    """Prune the chunks of ``purged`` nothing references or pins, if no write session is alive
    (checked after expiring the stale ones); the rows pruned."""
    index: GcIndex = repo.index
    if not purged or index.live_sessions():
        return []
    removed = index.prune_chunks(time.time(), ids=purged)
    report.purged_now = len(removed)
    return removed


def _grace_kept(
    repo: Repository,
    report: GCReport,
    cutoff: float,
    dropped: list[str],
    sessions: list[str] | None = None,
) -> None:
    """Fill in what the grace period keeps (unreferenced data not yet ``cutoff`` old; for a
    dry run: once ``dropped`` are forgotten and only ``sessions`` pin)."""
    index: GcIndex = repo.index
    count, size, newest = index.young_unreferenced(cutoff, ignoring=dropped, sessions=sessions)
    retired = [u for u in index.pack_usage() if u.retired_at is not None and u.retired_at > cutoff]
    report.grace_kept_chunks = count
    report.grace_kept_packs = len(retired)
    report.grace_kept_bytes = size + sum(u.size for u in retired)
    ends = [
        t + report.grace_seconds
        for t in [newest, *(u.retired_at for u in retired)]
        if t is not None
    ]
    report.grace_expires_at = max(ends) if ends else None


def _repack_sparse(
    repo: Repository,
    report: GCReport,
    cutoff: float,
    repack_below: float,
    progress: ProgressFn | None = None,
    any_age: bool = False,
) -> list[str]:
    """Retire the packs left without live chunks and rewrite the sparse ones older than
    ``cutoff`` (with ``any_age``, whatever their age); the packs retired now."""
    index: GcIndex = repo.index
    usage = [u for u in index.pack_usage() if u.retired_at is None]
    dead = [u.pack_id for u in usage if u.live_chunks == 0]
    retired = index.retire_packs(dead)
    report.packs_retired += len(retired)
    rewrite = sparse(usage, math.inf if any_age else cutoff, repack_below)
    if not rewrite:
        return retired
    gauge = meter(progress, "gc", sum(u.live_bytes for u in rewrite))
    # the new packs are written inside a write session, as a take's or a compaction's: another
    # gc that lists them before they are recorded sees a writer alive and deletes no orphan
    with Lease(index, repo.lease_seconds) as lease:
        for u in rewrite:
            if _rewrite_pack(repo, lease, u.pack_id, u.loose):
                report.packs_rewritten += 1
                done = index.retire_packs([u.pack_id])
                report.packs_retired += len(done)
                retired += done
            if gauge is not None:
                gauge.add(u.live_bytes)
        index.end_session(lease.id, "committed")  # nothing to commit: its packs are recorded
        lease.committed = True
    if gauge is not None:
        gauge.finish()
    return retired


def _rewrite_pack(repo: Repository, lease: Lease, pack_id: str, loose: bool) -> bool:
    """Copy a pack's live chunks (verified) into a new pack and switch the index to it.

    Payloads are copied as they are: a delta stays a delta against the same base (which the
    index keeps while the delta lives), so its chain, and every chain through it, reads the same;
    a loose pack's chunks stay loose (compaction rewrites them once no newest snapshot uses them).
    """
    index: GcIndex = repo.index
    live = [c for c in index.all_chunks() if c.pack_id == pack_id]
    if not live:
        return False
    known = index.chunk_locations(c.chunk_id for c in live if c.base_id is not None)
    writer = repo.objects.new_pack_writer(repo.config.pack_bytes * 4)
    name = objects.pack_name(pack_id)
    try:
        for c in live:
            payload = repo.objects.backend.get(name, c.offset, c.length)
            raw: bytes | bytearray | memoryview = objects.decode(
                c.codec, payload, c.raw_length
            )  # a delta's: its XOR bytes
            if (
                c.base_id is not None
            ):  # the bytes copied (not a second read) XORed with the verified base
                raw = bytearray(raw)
                xor_into(raw, repo.objects.read_chunk(to_location(c, known).chain()[1]))
            if objects.chunk_id(raw) != c.chunk_id:
                raise CorruptionError(
                    f"gc: chunk {c.chunk_id} in pack {pack_id} is damaged; run `ckstore check --read-data`"
                )
            writer.add(c.chunk_id, c.codec, payload, c.raw_length, c.base_id)
    except (
        ObjectNotFoundError
    ):  # a compaction beside moved the pack's chunks, or a base's, meanwhile
        writer.abort()
        return False
    except BaseException:
        writer.abort()
        raise
    done = writer.finish()
    assert done is not None
    new_id, size, locs = done
    moves = to_records(locs)
    if lease.error is not None:  # expired: the pack may be gone as an orphan already
        raise lease.error
    index.relocate_chunks(
        PackRecord(new_id, size, len(moves), time.time(), loose=loose), moves, pack_id, lease.id
    )
    return True


def _delete_retired(
    repo: Repository, report: GCReport, cutoff: float, only: list[str] | None = None
) -> None:
    index: GcIndex = repo.index
    remote = index.remote_pack_ids()  # packs of a remote: their rows go, the packs are the remote's
    for pack_id in index.delete_retired_packs(cutoff, only):  # rows first...
        if pack_id in remote:
            continue
        report.bytes_reclaimed += _pack_size(repo, pack_id) or 0  # None: an earlier gc's
        repo.objects.delete_pack(pack_id)  # ...then the object
        report.packs_removed += 1


def _pack_size(repo: Repository, pack_id: str) -> int | None:
    """The size of a pack, or None if it is gone (deleted by another gc meanwhile, or by an
    earlier one that was interrupted)."""
    try:
        return repo.objects.pack_size(pack_id)
    except ObjectNotFoundError:
        return None


def _delete_orphans(repo: Repository, report: GCReport, cutoff: float) -> None:
    """Delete packs/manifests the index does not know, what interrupted writes left (temporary
    files last written before both the listing and ``cutoff``) and abort unfinished uploads
    (S3 multipart uploads of writers killed mid-put, listed before the check), if no write
    session is alive.

    Every object was written inside some write session. After listing, the sessions past
    their lease are marked expired in the index, and if then no session is still marked
    active, each writer of a listed object either committed (so its objects are in the index
    by now) or ended/expired (and can no longer record anything): what the index lacks is
    garbage. A lease run out by this host's clock alone is not enough: a writer stopped inside
    its commit or its ``add_pack`` after the lease check (SIGSTOP, a suspended host, a clock
    behind this one) would still record what it wrote. Marking the session expired is a write
    ordered with the writer's own transaction (which holds its session row locked; SQLite
    serialises writes): the writer either recorded its objects first, and the index read
    below names them, or can never record them. The cost is that orphans wait for a moment
    when no take is running.
    """
    index: GcIndex = repo.index
    listed = time.time()
    packs = set(repo.objects.list_packs())
    manifests = set(repo.objects.list_blobs("manifests"))
    uploads = repo.objects.partial_uploads()
    index.expire_sessions(time.time())  # ordered with the writers' own transactions (above)
    if index.held_sessions():
        return
    report.orphans_removed += repo.objects.backend.sweep_temporary(min(listed, cutoff))
    for name, upload_id in uploads:  # listed before the check: their writers are gone too
        repo.objects.discard_upload(name, upload_id)
        report.uploads_aborted += 1
    for pack_id in packs - index.index_pack_ids():
        size = _pack_size(repo, pack_id)
        if size is None:
            continue  # another gc deleted it after this one listed it
        report.bytes_reclaimed += size
        repo.objects.delete_pack(pack_id)
        report.orphans_removed += 1
    report.orphans_removed += _delete_manifests(
        repo, sorted(manifests - index.index_manifest_ids())
    )


MANIFEST_BATCH = 64
"""Manifest objects a gc holds the bytes of at once while it deletes them."""


def _delete_manifests(repo: Repository, ids: Sequence[str]) -> int:
    """Delete these manifest objects, which no index row names (their rows pruned, or never
    recorded); how many stayed deleted.

    A manifest is named by its bytes, so a writer storing the same bytes again (a push or pull
    re-sending a snapshot, a take of the same manifest) finds the object in place and writes
    nothing: nothing of its own stops this gc deleting it before its commit names it. So each
    is read before it goes, and put back if a row names it once it is gone; the writer checks
    again after its commit (``ObjectStore.store_blob``). One of the two always sees the other:
    the object stays whenever a committed record names it.
    """
    index: GcIndex = repo.index
    gone = 0
    for at in range(0, len(ids), MANIFEST_BATCH):
        held: dict[str, bytes] = {}
        try:
            for mid in ids[at : at + MANIFEST_BATCH]:
                raw = repo.objects.blob_bytes("manifests", mid)
                if raw is not None:
                    held[mid] = raw
                    repo.objects.delete_blob("manifests", mid)
        finally:  # a read or delete that failed part way: what went is checked all the same
            named = index.index_manifest_ids(held)  # after the deletes: see store_blob
            for mid in named:
                repo.objects.put_blob_back("manifests", held[mid])
        gone += len(held) - len(named)
    return gone
