"""Push and pull: send snapshots, with their chunks, tags and lineage, from one store to another.

The destination's crash ordering for each snapshot is a take's (docs/RELIABILITY.md, I1):

1. If the destination has the snapshot already (same id: the id is its manifest's hash), it is
   only recorded as held there; nothing is sent.
2. Begin a write session at the destination (a lease, heartbeat, as a take).
3. Send the chunks it lacks (:mod:`.copy`: negotiate and pin, read and check, durable pack,
   then its index rows).
4. Put the manifest, byte for byte (so its id, and the snapshot's, is the same there).
5. Commit the snapshot, its chunk references and its tags in one index transaction. Before
   this nothing of it is visible at the destination; after it, all of it is. A push first
   reads the remote's ``ckstore.json`` again (:func:`.config.confirm`): a share that went away
   under an open handle (an empty mount point where the packs just went) commits nothing.
6. Record at the store that names the remote that the remote holds it.

Killed anywhere, the destination holds no partial snapshot: packs recorded before the kill are
unreferenced chunk rows that the next push finds (and does not send again) while gc's grace
period keeps them; a pack durable but not recorded is an orphan gc removes. Killed between 5
and 6, the next push finds the snapshot there (step 1) and records it. Snapshots are committed
run by run in commit order (:mod:`.select`), so each one's parent at the destination is the
one it followed here whenever the destination's run holds what was sent before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine import manifests
from ..engine.lease import Lease
from ..engine.progress import ProgressFn, meter
from ..engine.repository import describe
from ..engine.take.commit import commit_manifest
from ..errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    LeaseExpiredError,
    SnapshotNotFoundError,
    StorageError,
)
from ..format.manifest import Manifest
from ..index import SnapshotRecord
from .config import confirm
from .copy import ChunkCopier, CopyStats, shapes_of
from .select import Selection

if TYPE_CHECKING:
    from ..engine.interfaces import GcIndex, TransferIndex
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
    snapshots_damaged: list[str] = field(default_factory=list)
    """Snapshots not sent: a chunk or the manifest they need is damaged at the source."""
    chunks_healed: list[str] = field(default_factory=list)
    """Chunks of snapshots held here already whose local bytes were damaged, sent again from
    the remote (a pull naming them; counted in ``chunks_sent`` too)."""
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
            "snapshots_damaged": list(self.snapshots_damaged),
            "chunks_healed": list(self.chunks_healed),
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
        InvalidInputError: ``src`` and ``dst`` are the same store (:func:`same_store`).
        CorruptionError: a chunk or manifest read from ``src`` is damaged (named): the
            snapshots that need it are not committed, every other one is (and recorded), and
            then this is raised naming those left out and how many went.
        ConflictError: a snapshot's name, or its run's, is taken at the destination by
            something else; LeaseExpiredError: the transfer stalled past its lease there.
    """
    here, there = (src, dst) if direction == "push" else (dst, src)
    if same_store(src, dst):
        raise InvalidInputError(
            f"remote {remote!r} ({there.url}) is this store itself ({here.url}): nothing to "
            f"{direction}"
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
    damage: dict[str, CorruptionError] = {}
    with _source_pins(src) as pins:
        for snap in todo:
            try:
                _send(src, dst, snap, selection.tags_of(snap.id), report, force, pins, pause, tick)
            except CorruptionError as exc:  # that snapshot only: the others still go
                damage[snap.id] = exc
                report.snapshots_damaged.append(describe(snap))
                continue
            record([snap.id])
    _set_tags(dst, selection, report, force, damage.keys())
    if bar is not None:
        bar.finish()
    report.seconds = time.perf_counter() - t0
    if damage:
        raise _damaged(report, list(damage.values()))
    return report


def _damaged(report: TransferReport, damage: list[CorruptionError]) -> CorruptionError:
    """One error for the snapshots a damaged source kept from the destination."""
    names = report.snapshots_damaged
    return CorruptionError(
        f"{report.direction}: {len(names)} snapshot(s) were not committed at {report.destination}, "
        f"each needing damaged data of {report.source}: {', '.join(names)}. The first: {damage[0]}. "
        f"The {len(report.snapshots_sent)} other(s) were committed ({report.snapshots_present} "
        f"found there already); {report.direction} again once the source is repaired"
    )


def same_store(a: Repository, b: Repository) -> bool:
    """Whether ``a`` and ``b`` are one store: the same folder (a link to it included), URL or
    index. A copy of a store (``cp -r``) has its id, but is another store: it is told by its
    place, not by its id."""
    from ..engine.opening import is_local

    if is_local(a.url) and is_local(b.url):
        try:
            if os.path.samefile(a.url, b.url):
                return True
        except OSError:
            pass
    ia: TransferIndex = a.index
    ib: TransferIndex = b.index
    shared_index = ia.url == ib.url and ":memory:" not in ia.url
    return a.objects.backend.url == b.objects.backend.url or shared_index


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
        ours = src if report.direction == "push" else dst
        ChunkCopier(src, dst, lease.id, where, report.stats, pause, progress, ours).copy(
            ids, shapes_of(manifest)
        )
        if lease.error is not None:
            raise lease.error
        stored = (dst.objects.put_blob("manifests", raw), len(raw))
        if report.direction == "push":  # the remote is still where its packs just went
            confirm(dst, report.remote)
        specs = _tag_specs(dst, tags, snap.id, force, report)
        committed = _commit(dst, lease.id, manifest, stored, specs, snap, report)
        lease.committed = True
    if committed is not None:
        _manifest_kept(dst, raw, committed)
    report.manifest_bytes += len(raw)
    report.snapshots_sent.append(describe(snap))
    if committed is not None:
        dst.committed(committed)


PUT_BACK_TRIES = 3
"""Attempts at putting back a manifest a gc at the destination deleted (``_manifest_kept``)."""


def _manifest_kept(dst: Repository, raw: bytes, committed: SnapshotRecord) -> None:
    """After the commit, put the manifest back if a gc at the destination deleted it meanwhile
    (``ObjectStore.store_blob``: a manifest is named by its bytes, so it may have been there
    already, listed by a gc as an orphan or with its row pruned; even one this push wrote may
    carry a name such a gc listed before). If that fails, the snapshot, unreadable without it,
    is deleted there again so that the next transfer sends it again, and the error raised.

    Raises:
        StorageError: the manifest could not be put back (the snapshot was deleted there).
    """
    for attempt in range(PUT_BACK_TRIES):
        try:
            dst.objects.put_blob_back("manifests", raw)
            return
        except StorageError as exc:
            if attempt + 1 < PUT_BACK_TRIES:
                time.sleep(0.5 * (attempt + 1))
                continue
            try:
                index: GcIndex = dst.index
                index.delete_snapshot(committed.id)
            except CkstoreError:
                pass
            raise StorageError(
                f"snapshot {describe(committed)} was committed at {dst.url}, but its manifest, "
                f"deleted there by a gc meanwhile, could not be put back ({exc}); the snapshot "
                "was deleted there again: transfer it again once the storage answers"
            ) from exc


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


def _set_tags(
    dst: Repository,
    selection: Selection,
    report: TransferReport,
    force: bool,
    left_out: Collection[str] = (),
) -> None:
    """Tags of snapshots the destination held already (the others went with their commits);
    none of a snapshot ``left_out`` (damaged at the source)."""
    index: TransferIndex = dst.index
    done = set(report.tags_set) | set(report.tags_rejected)
    for name, sid in sorted(selection.tags.items()):
        if name in done or sid in left_out:
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
