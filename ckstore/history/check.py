"""Integrity check (restic ``check`` for checkpoints).

Structure (always): every snapshot's manifest exists, hashes to its id and parses; every chunk
it names has an index row and a ``snapshot_chunks`` reference; every pack holding live chunks
exists, its header, trailer and footer hash to its name, and its own trailer agrees with the
index about each chunk's place, length and codec.
Data (``read_data=True`` or a fraction of packs): each pack chosen is read whole
(:func:`ckstore.objects.scan_pack`): its payloads must fill it exactly, every chunk in it
must decode to bytes that hash to its id (a delta through its chain of bases, each read and
verified), and every payload digest the index recorded must be the payload's. A fraction reads that share of the packs, chosen at
random, and at least one. The report counts the packs, chunks and bytes read.
Orphans (objects the index does not know, e.g. from a crashed take) are listed but are not
errors: ``gc`` removes them.

Each problem with a damaged or missing chunk or pack also names what it breaks: the snapshots
that use it and their keys (a chunk that deltas are stored against breaks theirs too), in
``snapshots`` and ``keys`` and at the end of its message, so the damage can be judged (restore
another snapshot? re-take?) without reading manifests by hand.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine.locations import to_location
from ..errors import CkstoreError
from ..format.limits import check_fraction
from ..format.manifest import Manifest, PerRankEntry, TensorEntry
from ..index import ChunkRecord, SnapshotRecord

if TYPE_CHECKING:
    from ..engine.interfaces import CheckIndex
    from ..engine.repository import Repository


@dataclass(frozen=True)
class Problem:
    """One thing wrong: what kind, which object, and a sentence for humans; for damaged data,
    the snapshots (``run@step (id)``) and keys that use it."""

    kind: str
    object: str
    message: str
    snapshots: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()


@dataclass
class CheckReport:
    """The outcome of a check; ``ok`` is False iff ``problems`` is non-empty."""

    snapshots: int = 0
    packs: int = 0
    chunks: int = 0
    packs_read: int = 0
    chunks_read: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    orphan_packs: list[str] = field(default_factory=list)
    orphan_manifests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, obj: str, message: str) -> None:
        self.problems.append(Problem(kind, obj, message))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def check(
    repo: Repository,
    read_data: bool | float = False,
    seed: int | None = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> CheckReport:
    """Check the store; ``read_data`` True reads every pack whole, a number in [0, 1] that share
    of the packs (at least one when above 0).

    ``progress`` wraps the per-pack loop of the data pass (the CLI passes a progress bar);
    ``seed`` makes the choice of packs repeatable.

    Raises:
        InvalidInputError: ``read_data`` is not a bool or a number in [0, 1].
    """
    index: CheckIndex = repo.index
    fraction = check_fraction("check: read_data", read_data)
    repo.write_backs.wait()  # healed chunks land before the packs are judged
    report = CheckReport()
    snapshots = index.list_snapshots()  # before the chunks: a take committing meanwhile adds both
    chunks = {c.chunk_id: c for c in index.all_chunks()}
    report.chunks = len(chunks)
    _check_snapshots(repo, snapshots, chunks, report)
    readable = _check_packs(repo, chunks, report)
    if fraction > 0 and readable:
        chosen = choose_packs(readable, fraction, random.Random(seed))
        _read_data(repo, chosen, report, progress or (lambda it: it), chunks)
    _drop_moved(repo, report, chunks)
    _name_users(repo, report, chunks)
    return report


PACK_PROBLEMS = ("missing-pack", "unknown-pack", "pack", "remote-pack")
"""Problems about a whole pack, which a compaction or gc beside the check may cause by moving
every live chunk out of the pack and deleting it while the check ran."""


def _drop_moved(repo: Repository, report: CheckReport, chunks: dict[str, ChunkRecord]) -> None:
    """Drop the pack problems of packs whose chunks all moved elsewhere since the check read
    the index (looked up again now): the pack was emptied and deleted meanwhile, no damage."""
    index: CheckIndex = repo.index
    suspects = {p.object for p in report.problems if p.kind in PACK_PROBLEMS}
    if not suspects:
        return
    held = {c.chunk_id: c.pack_id for c in chunks.values() if c.pack_id in suspects}
    now = index.chunk_locations(list(held))
    still = {rec.pack_id for cid, rec in now.items() if rec.pack_id == held.get(cid)}
    gone = suspects - still
    if gone:
        report.problems = [
            p for p in report.problems if not (p.kind in PACK_PROBLEMS and p.object in gone)
        ]
        for cid, pack_id in held.items():
            rec = now.get(cid)
            if pack_id in gone and rec is not None:  # the row as it is now (the users named below)
                chunks[cid] = rec


MAX_NAMED = 10
"""Snapshots and keys named in a problem's message (its fields hold them all)."""


def _name_users(repo: Repository, report: CheckReport, chunks: dict[str, ChunkRecord]) -> None:
    """Add to each problem about a chunk or a pack the snapshots and keys it breaks."""
    index: CheckIndex = repo.index
    in_pack: dict[str, set[str]] = defaultdict(set)
    deltas: dict[str, set[str]] = defaultdict(set)
    for c in chunks.values():
        in_pack[c.pack_id].add(c.chunk_id)
        if c.base_id is not None:
            deltas[c.base_id].add(c.chunk_id)
    broken: dict[int, set[str]] = {}
    for i, p in enumerate(report.problems):
        ids = {p.object} if p.object in chunks else set(in_pack.get(p.object, ()))
        todo = list(ids)
        while todo:  # what is stored as a delta against a broken chunk is broken too
            for d in deltas.get(todo.pop(), ()):
                if d not in ids:
                    ids.add(d)
                    todo.append(d)
        if ids:
            broken[i] = ids
    if not broken:
        return
    users = index.snapshots_using(set().union(*broken.values()))
    named = _Names(repo)
    for i, ids in broken.items():
        snaps = sorted({s for c in ids for s in users.get(c, ())}, key=named.order)
        if not snaps:
            continue
        labels = tuple(named.label(s) for s in snaps)
        keys = tuple(sorted({k for s in snaps for k in named.keys(s, ids)}))
        p = report.problems[i]
        shown = ", ".join(labels[:MAX_NAMED]) + (
            f" and {len(labels) - MAX_NAMED} more" if len(labels) > MAX_NAMED else ""
        )
        keys_shown = ", ".join(keys[:MAX_NAMED]) + (
            f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else ""
        )
        message = f"{p.message}; used by snapshot(s) {shown}" + (
            f", key(s) {keys_shown}" if keys else ""
        )
        report.problems[i] = Problem(p.kind, p.object, message, labels, keys)


class _Names:
    """Snapshot labels and manifests, each read once."""

    def __init__(self, repo: Repository) -> None:
        self._store = repo
        self._index: CheckIndex = repo.index
        self._manifests: dict[str, Manifest | None] = {}
        self._records: dict[str, SnapshotRecord] = {}

    def record(self, snapshot_id: str) -> SnapshotRecord:
        if snapshot_id not in self._records:
            self._records[snapshot_id] = self._index.get_snapshot(snapshot_id)
        return self._records[snapshot_id]

    def order(self, snapshot_id: str) -> tuple[str, int, float]:
        """Run, then step, then time: the order ``log`` readers expect."""
        r = self.record(snapshot_id)
        return (r.run, -1 if r.step is None else r.step, r.created_at)

    def label(self, snapshot_id: str) -> str:
        r = self.record(snapshot_id)
        where = r.name or (f"{r.run}@{r.step}" if r.step is not None else r.run)
        return f"{where} ({snapshot_id[:12]})"

    def keys(self, snapshot_id: str, ids: set[str]) -> list[str]:
        if snapshot_id not in self._manifests:
            try:
                self._manifests[snapshot_id] = self._store.load_manifest(self.record(snapshot_id))
            except CkstoreError:  # reported as its own problem
                self._manifests[snapshot_id] = None
        manifest = self._manifests[snapshot_id]
        if manifest is None:
            return []
        return [
            key
            for key, entry in manifest.entries.items()
            if any(c.id in ids for t in _tensors(entry) for c in t.chunks)
        ]


def _tensors(entry: Any) -> list[Any]:
    if isinstance(entry, TensorEntry):
        return [entry]
    if isinstance(entry, PerRankEntry):
        return list(entry.tensors())
    return []


def choose_packs(pack_ids: list[str], fraction: float, rng: random.Random) -> list[str]:
    """``fraction`` of ``pack_ids`` (rounded up, so at least one), chosen at random, sorted."""
    if fraction >= 1.0:
        return sorted(pack_ids)
    count = min(len(pack_ids), max(1, math.ceil(fraction * len(pack_ids))))
    return sorted(rng.sample(sorted(pack_ids), count))


def _check_snapshots(
    repo: Repository,
    snapshots: list[SnapshotRecord],
    chunks: dict[str, ChunkRecord],
    report: CheckReport,
) -> None:
    index: CheckIndex = repo.index
    for snap in snapshots:
        report.snapshots += 1
        where = f"snapshot {snap.run}@{snap.step} ({snap.id[:12]})"
        try:  # one stored in parts is read whole: its parts are verified like any chunk
            manifest = repo.load_manifest(snap)
        except CkstoreError as exc:
            report.add("manifest", snap.manifest_id, f"{where}: manifest unreadable: {exc}")
            continue
        needed = manifest.referenced_ids()
        missing = needed - chunks.keys()
        if missing:
            report.add(
                "missing-chunk",
                snap.id,
                f"{where}: {len(missing)} chunk(s) unknown to the index, e.g. {min(missing)}",
            )
        refs = index.snapshot_chunk_ids(snap.id)
        if refs != needed:
            report.add(
                "references",
                snap.id,
                f"{where}: index references {len(refs)} chunks, manifest needs {len(needed)}",
            )


def _check_packs(
    repo: Repository, chunks: dict[str, ChunkRecord], report: CheckReport
) -> list[str]:
    """Check every pack holding live chunks; return those whose chunk table could be read."""
    index: CheckIndex = repo.index
    by_pack: dict[str, list[ChunkRecord]] = defaultdict(list)
    for c in chunks.values():
        by_pack[c.pack_id].append(c)
    stored = set(repo.objects.list_packs())
    known = index.index_pack_ids()
    report.orphan_packs = sorted(stored - known)
    report.orphan_manifests = sorted(
        set(repo.objects.list_blobs("manifests")) - index.index_manifest_ids()
    )
    readable = []
    rows = index.pack_row_ids()
    remote = index.remote_pack_ids()
    for pack_id, live in sorted(by_pack.items()):
        report.packs += 1
        if pack_id in remote:
            _check_remote_pack(repo, pack_id, remote[pack_id], live, report)
            continue
        if pack_id not in rows:
            report.add(
                "unknown-pack",
                pack_id,
                f"{len(live)} chunk row(s) of the index name pack {pack_id}, which has no pack row (a damaged index: rebuild it with `ckstore reindex`)",
            )
        if pack_id not in stored:
            report.add(
                "missing-pack",
                pack_id,
                f"pack {pack_id} holds {len(live)} live chunk(s) but is missing from the store",
            )
            continue
        try:
            idx = objects.load_pack_index(repo.objects.backend, pack_id)
        except CkstoreError as exc:
            report.add("pack", pack_id, f"pack {pack_id} is unreadable: {exc}")
            continue
        readable.append(pack_id)
        if idx.computed_id != pack_id:
            report.add(
                "pack-id",
                pack_id,
                f"pack {pack_id} does not match its name: its header, trailer and footer hash to {idx.computed_id}",
            )
        trailer = {loc.chunk_id: loc for loc in idx.locations}
        for c in live:
            loc = trailer.get(c.chunk_id)
            if loc is None or (loc.offset, loc.length, loc.raw_length, loc.codec, loc.base_id) != (
                c.offset,
                c.length,
                c.raw_length,
                c.codec,
                c.base_id,
            ):
                report.add(
                    "misplaced-chunk",
                    c.chunk_id,
                    f"chunk {c.chunk_id}: the index and pack {pack_id} disagree about it",
                )
    _check_chains(chunks, report)
    return readable


def _check_remote_pack(
    repo: Repository, pack_id: str, remote: str, live: list[ChunkRecord], report: CheckReport
) -> None:
    """A pack of a remote that rows of chunks evicted from this (local) tier point at: it must
    be there (its data is checked by a check of the remote)."""
    try:
        there = repo.objects.backend.exists(objects.pack_name(pack_id))
    except CkstoreError as exc:
        report.add(
            "remote-pack",
            pack_id,
            f"pack {pack_id} of remote {remote!r} ({len(live)} chunk(s) evicted there) could not be reached: {exc}",
        )
        return
    if not there:
        report.add(
            "remote-pack",
            pack_id,
            f"pack {pack_id} of remote {remote!r} holds {len(live)} chunk(s) this store evicted there, but the remote has no such pack (check the remote: `ckstore check` there)",
        )


def _check_chains(chunks: dict[str, ChunkRecord], report: CheckReport) -> None:
    """Every delta's base is indexed, one link shallower, with the same length."""
    for c in chunks.values():
        if c.base_id is None:
            if c.depth != 0:
                report.add(
                    "delta-chain",
                    c.chunk_id,
                    f"chunk {c.chunk_id} is stored whole but the index gives it depth {c.depth}",
                )
            continue
        base = chunks.get(c.base_id)
        if base is None:
            report.add(
                "missing-base",
                c.chunk_id,
                f"chunk {c.chunk_id} is a delta against chunk {c.base_id}, which the index does not know (rebuild it with `ckstore reindex`)",
            )
        elif base.depth + 1 != c.depth or base.raw_length != c.raw_length:
            report.add(
                "delta-chain",
                c.chunk_id,
                f"chunk {c.chunk_id} (depth {c.depth}, {c.raw_length} bytes) is a delta against chunk {c.base_id} (depth {base.depth}, {base.raw_length} bytes)",
            )


def _read_data(
    repo: Repository,
    pack_ids: list[str],
    report: CheckReport,
    progress: Callable[[Iterable[Any]], Iterable[Any]],
    chunks: dict[str, ChunkRecord],
) -> None:
    """Scan ``pack_ids`` whole. A chunk the index no longer places in its pack is garbage gc
    left there (the pack is live enough to keep): a delta whose base is gone, or a damaged copy
    healed into another pack (``Store.repair``), which is no damage."""
    known: dict[str, ChunkRecord] = {}
    index: CheckIndex = repo.index

    def base_of(loc: objects.ChunkLocation) -> Any:
        """The verified raw bytes of a delta's base, read through its own chain."""
        assert loc.base_id is not None
        if loc.base_id not in known:
            known.update(index.chunk_locations([loc.base_id]))
        rec = known.get(loc.base_id)
        if rec is None:
            raise CkstoreError("the index does not know it")
        return repo.objects.read_chunk(to_location(rec, known))

    for pack_id in progress(pack_ids):
        try:
            scan = objects.scan_pack(repo.objects.backend, pack_id, bases=base_of)
        except CkstoreError as exc:
            report.add("pack", pack_id, f"pack {pack_id} could not be read whole: {exc}")
            continue
        report.packs_read += 1
        report.chunks_read += scan.chunks_read
        report.bytes_read += scan.bytes_read
        for p in scan.problems:
            elsewhere = p.object in chunks and chunks[p.object].pack_id != pack_id
            dead = elsewhere or (p.kind == "missing-base" and p.object not in chunks)
            if p.kind != "pack-id" and not dead:  # the structure pass reported pack-id already
                report.add(p.kind, p.object, p.message)
        damaged = {p.object for p in scan.problems}
        _check_digests(
            pack_id, {c: d for c, d in scan.digests.items() if c not in damaged}, chunks, report
        )


def _check_digests(
    pack_id: str, digests: dict[str, str], chunks: dict[str, ChunkRecord], report: CheckReport
) -> None:
    """Report index rows whose payload digest the pack's payload does not have (chunks found
    damaged are reported as such already): an atomic restore refuses such a chunk even when
    its bytes are right."""
    for cid, found in digests.items():
        rec = chunks.get(cid)
        if rec is not None and rec.pack_id == pack_id and rec.payload_digest not in (None, found):
            report.add(
                "payload-digest",
                cid,
                f"the index records payload digest {rec.payload_digest} for chunk {cid} in pack "
                f"{pack_id}, whose payload there has {found}: atomic restores refuse the chunk. If no "
                "other problem names it, its bytes are right: restore(atomic=False) reads it, "
                "verified against its id, and an index rebuilt by `ckstore reindex` records no digest",
            )
