"""What a gc does to packs, decided from the index alone: one rule for the gc and its dry run.

A dry run (``gc(..., dry_run=True)``, ``ckstore gc --dry-run``) predicts the figures of the gc
that would run instead, from the same rules on the same rows, without writing anything:

1. the write sessions the gc would expire (lease run out, process known gone) lose their pins;
2. the chunk rows it would prune: what nothing but the forgotten snapshots references, nothing
   but the surviving sessions pins, older than the grace period (a base with its last delta);
3. each pack's usage once those rows are gone: packs left without a chunk are retired, sparse
   ones (:func:`sparse`) rewritten and retired;
4. the packs it would delete: retired before the grace period (with ``grace_seconds=0``,
   those it retires itself too), and, when no write session is alive, orphans (in the store,
   unknown to the index).

``bytes_reclaimed`` is the stored size of the packs it would delete, read from the store as
the gc reads it, so a dry run's figure is the gc's, byte for byte, when nothing else writes or
deletes in between. What a dry run does not predict: the temporary files the gc would sweep
(counted in ``orphans_removed`` by the gc only) and a sparse pack whose rewrite a concurrent
compaction defeats.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .. import objects
from ..engine.lease import gone
from ..errors import ObjectNotFoundError
from ..index.records import PackUsage

if TYPE_CHECKING:
    from ..engine.interfaces import GcIndex
    from ..engine.repository import Repository


@dataclass
class Prediction:
    """The figures of a gc, predicted (their meaning: ``GCReport``'s fields of the same name)."""

    chunks_removed: int = 0
    chunk_bytes_removed: int = 0
    packs_rewritten: int = 0
    packs_retired: int = 0
    packs_removed: int = 0
    manifests_removed: int = 0
    orphans_removed: int = 0
    uploads_aborted: int = 0
    bytes_reclaimed: int = 0
    staying: list[str] = field(default_factory=list)
    """Ids of the write sessions the gc would leave active (only their pins count)."""


def payload(u: PackUsage) -> int:
    """A pack's payload bytes (never more than that: version 2 entries assumed)."""
    return max(1, u.size - objects.pack_overhead(u.chunk_count, deltas=True))


def sparse(usage: list[PackUsage], cutoff: float, repack_below: float) -> list[PackUsage]:
    """The packs of ``usage`` that a gc rewrites: the store's own, older than ``cutoff``, some
    but not all of their chunks live, and live bytes below ``repack_below`` of the payload.

    A pack whose every entry is live has nothing to reclaim (and :func:`payload` misjudges
    a version 1 pack's payload, which made such packs look sparse to every gc).
    """
    return [
        u
        for u in usage
        if u.remote is None
        and 0 < u.live_chunks < u.chunk_count
        and u.created_at < cutoff
        and u.live_bytes < repack_below * payload(u)
    ]


def staying_sessions(index: GcIndex) -> list[str]:
    """Ids of the write sessions a gc now would leave active (the others lose their pins)."""
    return [s.id for s in index.live_sessions() if not gone(s.owner)]


def predict(
    repo: Repository,
    now: float,
    grace_seconds: float,
    dropped: list[str],
    repack_below: float,
) -> Prediction:
    """What a gc at ``now`` would prune, retire, rewrite and delete once ``dropped`` are
    forgotten (module docstring)."""
    index: GcIndex = repo.index
    cutoff = now - grace_seconds
    staying = staying_sessions(index)
    report = Prediction(staying=staying)
    pruned = index.unreferenced_chunks(cutoff, ignoring=dropped, sessions=staying)
    report.chunks_removed = len(pruned)
    report.chunk_bytes_removed = sum(c.length for c in pruned)
    gone_count = Counter(c.pack_id for c in pruned)
    gone_bytes: Counter[str] = Counter()
    for c in pruned:
        gone_bytes[c.pack_id] += c.length
    usage = [
        replace(
            u,
            live_chunks=u.live_chunks - gone_count[u.pack_id],
            live_bytes=u.live_bytes - gone_bytes[u.pack_id],
        )
        for u in index.pack_usage()
    ]
    retiring = [u for u in usage if u.retired_at is None and u.live_chunks == 0]
    rewritten = sparse([u for u in usage if u.retired_at is None], cutoff, repack_below)
    report.packs_retired = len(retiring) + len(rewritten)
    report.packs_rewritten = len(rewritten)
    deleted = [
        u.pack_id
        for u in usage
        if u.retired_at is not None and u.retired_at <= cutoff and u.live_chunks == 0
    ]
    if grace_seconds == 0:  # what it retires now is past a grace period of 0 at once
        deleted += [u.pack_id for u in [*retiring, *rewritten]]
    remote = index.remote_pack_ids()
    for pack_id in deleted:
        if pack_id not in remote:
            report.bytes_reclaimed += _stored_size(repo, pack_id)
            report.packs_removed += 1
    report.manifests_removed = len(index.prune_manifests(cutoff, dry_run=True, ignoring=dropped))
    if not staying:
        _predict_orphans(repo, report)
    return report


def _predict_orphans(repo: Repository, report: Prediction) -> None:
    """Packs and manifests in the store the index does not know, and unfinished uploads: what
    a gc deletes when no write session is alive."""
    index: GcIndex = repo.index
    for pack_id in set(repo.objects.list_packs()) - index.index_pack_ids():
        report.bytes_reclaimed += _stored_size(repo, pack_id)
        report.orphans_removed += 1
    manifests = set(repo.objects.list_blobs("manifests"))
    report.orphans_removed += len(manifests - index.index_manifest_ids())
    report.uploads_aborted = len(repo.objects.partial_uploads())


def _stored_size(repo: Repository, pack_id: str) -> int:
    try:
        return repo.objects.pack_size(pack_id)
    except ObjectNotFoundError:  # deleted by an earlier, interrupted gc: nothing to free
        return 0
