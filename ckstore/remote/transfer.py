"""Push and pull: send snapshots, with their chunks, tags and lineage, from one store to another.

The destination's crash ordering for each snapshot is a take's (docs/RELIABILITY.md, I1):

1. If the destination has the snapshot already (same id: the id is its manifest's hash), it is
   only recorded as held there; nothing is sent.
2. Begin a write session at the destination (a lease, heartbeat, as a take).
3. Send the chunks it lacks (:mod:`.copy`: negotiate and pin, read and check, durable pack,
   then its index rows).
4. Put the manifest, byte for byte (so its id, and the snapshot's, is the same there).
5. Commit the snapshot, its chunk references and its tags in one index transaction. Before
   this nothing of it is visible at the destination; after it, all of it is.
6. Record at the store that names the remote that the remote holds it.

Killed anywhere, the destination holds no partial snapshot: packs recorded before the kill are
unreferenced chunk rows that the next push finds (and does not send again) while gc's grace
period keeps them; a pack durable but not recorded is an orphan gc removes. Killed between 5
and 6, the next push finds the snapshot there (step 1) and records it. Snapshots are committed
run by run in commit order (:mod:`.select`), so each one's parent at the destination is the
one it followed here whenever the destination's run holds what was sent before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine import manifests
from ..engine.lease import Lease
from ..engine.progress import ProgressFn, meter
from ..engine.repository import describe
from ..engine.take.commit import commit_manifest
from ..errors import ConflictError, InvalidInputError, LeaseExpiredError, SnapshotNotFoundError
from ..format.manifest import Manifest
from ..index import SnapshotRecord
from .copy import ChunkCopier, CopyStats, shapes_of
from .select import Selection

if TYPE_CHECKING:
    from ..engine.interfaces import TransferIndex
    from ..engine.repository import Repository


@dataclass
class TransferReport:
    """What a push or pull did (``to_dict`` for ``--json``)."""

    direction: str
    remote: str
    source: str
    destination: str
    created: bool = False
    """The destination store did not exist and was created (a first push)."""
    snapshots_sent: list[str] = field(default_factory=list)
    snapshots_present: int = 0
    """Snapshots the destination held already (recorded, not sent)."""
    tags_set: list[str] = field(default_factory=list)
    tags_rejected: list[str] = field(default_factory=list)
    """Tags the destination holds at another snapshot (moved only with ``force``)."""
    stats: CopyStats = field(default_factory=CopyStats)
    manifest_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "direction": self.direction,
            "remote": self.remote,
            "source": self.source,
            "destination": self.destination,
            "created": self.created,
            "snapshots_sent": list(self.snapshots_sent),
            "snapshots_present": self.snapshots_present,
            "tags_set": list(self.tags_set),
            "tags_rejected": list(self.tags_rejected),
        }
        d.update(self.stats.to_dict())
        d["manifest_bytes"] = self.manifest_bytes
        d["seconds"] = self.seconds
        d["bytes_per_second"] = int(self.stats.bytes_sent / self.seconds) if self.seconds > 0 else 0
        return d


def transfer(
    src: Repository,
    dst: Repository,
    selection: Selection,
    *,
    direction: str,
    remote: str,
    record: Callable[[list[str]], None],
    force: bool = False,
    pause: Callable[[], bool] | None = None,
    progress: ProgressFn | None = None,
) -> TransferReport:
    """Send ``selection`` from ``src`` to ``dst`` (module docstring); ``record`` is called with
    the ids of the snapshots ``dst`` holds (sent now or found there) as each is done.

    ``force`` moves tags the destination holds at other snapshots (else they are reported in
    ``tags_rejected``); ``pause`` is polled between reads (a background push waits while the
    process takes or restores); ``progress(what, done, total)`` (``what`` is ``direction``) is
    told the stored bytes of the chunks sent or found there so far, out of those of the
    snapshots to send (:mod:`ckstore.engine.progress`).

    Raises:
        InvalidInputError: ``src`` and ``dst`` are the same store.
        CorruptionError: a chunk or manifest read from ``src`` is damaged (named); the snapshot
            being sent is not committed, those before it are.
        ConflictError: a snapshot's name, or its run's, is taken at the destination by
            something else; LeaseExpiredError: the transfer stalled past its lease there.
    """
    if src.config.store_id == dst.config.store_id:
        raise InvalidInputError(
            f"remote {remote!r} is this store itself ({dst.url}): nothing to {direction}"
        )
    t0 = time.perf_counter()
    report = TransferReport(direction, remote, src.url, dst.url)
    todo = [s for s in selection.snapshots if not _present(dst, s)]
    present = [s.id for s in selection.snapshots if s not in todo]
    if present:
        record(present)
        report.snapshots_present = len(present)
    source: TransferIndex = src.index
    total = sum(source.stored_bytes(s.id) for s in todo)
    bar = meter(progress, direction, total)
    tick = None if bar is None else bar.add
    with _source_pins(src) as pins:
        for snap in todo:
            _send(src, dst, snap, selection.tags_of(snap.id), report, force, pins, pause, tick)
            record([snap.id])
    _set_tags(dst, selection, report, force)
    if bar is not None:
        bar.finish()
    report.seconds = time.perf_counter() - t0
    return report


def _present(dst: Repository, snap: SnapshotRecord) -> bool:
    index: TransferIndex = dst.index
    try:
        index.get_snapshot(snap.id)
        return True
    except SnapshotNotFoundError:
        return False


class _source_pins:  # noqa: N801 - a context manager used like a function
    """A session at the source pinning what is read (a gc there cannot prune it meanwhile, even
    if the snapshot is deleted); none when the source is read-only."""

    def __init__(self, src: Repository) -> None:
        self._index: TransferIndex = src.index
        self.lease = None if src.read_only else Lease(self._index, src.lease_seconds)

    def __enter__(self) -> _source_pins:
        if self.lease is not None:
            self.lease.__enter__()
        return self

    def pin(self, chunk_ids: set[str]) -> None:
        if self.lease is not None:
            self._index.lookup_chunks(self.lease.id, sorted(chunk_ids))

    def __exit__(self, *exc: object) -> None:
        if self.lease is not None:
            self.lease.__exit__(*exc)


def _send(
    src: Repository,
    dst: Repository,
    snap: SnapshotRecord,
    tags: list[str],
    report: TransferReport,
    force: bool,
    pins: _source_pins,
    pause: Callable[[], bool] | None,
    progress: Callable[[int], None] | None,
) -> None:
    where = f"{report.direction} of snapshot {describe(snap)} to {dst.url}"
    raw = src.objects.get_blob("manifests", snap.manifest_id)  # verified against its id
    where_read = f"manifest of snapshot {describe(snap)} in {src.url}"
    manifest = manifests.load(src.objects, src.index, raw, where_read)  # parts are chunks: sent
    ids = manifest.referenced_ids()
    pins.pin(ids)
    with Lease(dst.index, dst.lease_seconds) as lease:
        ChunkCopier(src, dst, lease.id, where, report.stats, pause, progress).copy(
            ids, shapes_of(manifest)
        )
        if lease.error is not None:
            raise lease.error
        stored = (dst.objects.put_blob("manifests", raw), len(raw))
        specs = _tag_specs(dst, tags, snap.id, force, report)
        committed = _commit(dst, lease.id, manifest, stored, specs, snap, report)
        lease.committed = True
    report.manifest_bytes += len(raw)
    report.snapshots_sent.append(describe(snap))
    if committed is not None:
        dst.committed(committed)


def _commit(
    dst: Repository,
    session: str,
    manifest: Manifest,
    stored: tuple[str, int],
    specs: list[str],
    snap: SnapshotRecord,
    report: TransferReport,
) -> SnapshotRecord | None:
    """Commit at the destination; a tag refused there is reported (the snapshot still goes), and a
    push beside this one that committed the same snapshot first leaves it to that one (None)."""
    index: TransferIndex = dst.index

    def commit(tags: list[str]) -> SnapshotRecord:
        return commit_manifest(
            index,
            session,
            manifest,
            stored,
            tags,
            new_bytes=snap.new_bytes,
            new_chunks=snap.new_chunks,
            reused_chunks=snap.reused_chunks,
        )

    try:
        rec = commit(specs)
        report.tags_set += [s.lstrip("+") for s in specs]
        return rec
    except LeaseExpiredError:
        raise
    except ConflictError:
        if _present(dst, snap):  # another push committed it first
            index.end_session(session, "aborted")
            return None
        if not specs:
            raise
    rec = commit([])  # without the tags refused
    report.tags_rejected += [s.lstrip("+") for s in specs]
    return rec


def _tag_specs(
    dst: Repository, names: list[str], snapshot_id: str, force: bool, report: TransferReport
) -> list[str]:
    index: TransferIndex = dst.index
    specs = []
    for name in names:
        held = index.get_tag(name)
        if held is None:
            specs.append(name)
        elif held.snapshot_id != snapshot_id:
            if force:
                specs.append(f"+{name}")
            else:
                report.tags_rejected.append(name)
    return specs


def _set_tags(dst: Repository, selection: Selection, report: TransferReport, force: bool) -> None:
    """Tags of snapshots the destination held already (the others went with their commits)."""
    index: TransferIndex = dst.index
    done = set(report.tags_set) | set(report.tags_rejected)
    for name, sid in sorted(selection.tags.items()):
        if name in done:
            continue
        held = index.get_tag(name)
        if held is not None and held.snapshot_id == sid:
            continue
        if held is not None and not force:
            report.tags_rejected.append(name)
            continue
        try:
            index.set_tag(name, sid, force=force)
            report.tags_set.append(name)
        except (ConflictError, SnapshotNotFoundError):
            report.tags_rejected.append(name)
