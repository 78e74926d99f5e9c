"""Heal damaged local chunks from a remote that holds them (docs/RELIABILITY.md, I7).

A chunk whose local bytes fail their check (a flipped bit on disk, a truncated or deleted
pack) is, on a store with remotes, often still whole at one of them: the tier remote of a
two-tier store holds every pushed snapshot, and any remote a snapshot was pushed to holds
its chunks. :func:`heal` brings such chunks back:

1. :func:`damaged` reads each chunk asked about here, verified against its id; those that
   fail (or whose pack is gone) are the damaged ones.
2. For each damaged chunk, each remote (the one named, else every configured one, in order)
   is asked where it holds the chunk; its bytes are read there, decoded (a delta through the
   remote's chain) and hashed against the id this store asked for (``read_chunk`` without a
   check: BLAKE3 against the id; the remote's own digests prove nothing, I7). A remote that
   lacks it, or whose copy is damaged too, is passed over.
3. The verified bytes are encoded here as a whole chunk (never a delta: the base may be the
   damaged one) into a new local pack, made durable: loose (raw, in a pack marked loose, which
   compaction rewrites densely later) when every chunk healed was loose, as a take writes
   them, else compressed; then one index transaction per damaged
   pack points the chunks' rows at the new pack, each a compare-and-swap on the old pack (a
   chunk gc or compaction moved meanwhile is left alone), as compaction and gc do. Nothing is
   overwritten in place: the damaged payload is garbage in its old pack, which gc repacks.
4. A chunk no remote gave back is read here again: a delta that counted as damaged only
   because its base was reads back sound once the base is healed, and is not unrecoverable.

A read that heals (``_heal_verbs.RestoreHealer``) splits this: :func:`fetch` does steps 1-2
for whole chunks and keeps their verified bytes, which the read uses at once; :func:`write_back`
does step 3 for them later, behind the read, on the store handle's write-back thread
(``engine/write_backs.py``). Every guarantee above holds: the bytes are verified against the
id asked for before anyone uses them, the pack is durable before any row switches, each
switch is a compare-and-swap on the row's place before the fetch, and nothing is overwritten
in place. Until the write-back lands the rows still name the damaged copy and the remote still
holds the chunk: a crash meanwhile loses nothing (the next read heals again).

Killed after the new pack is durable and before the rows switch, the new pack is an orphan
gc removes, and the chunk is still damaged (a later read heals it again). Chunks evicted to a
remote (their rows point at the remote's pack) are not local copies and are left alone.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.lease import Lease
from ..engine.locations import to_location, to_records
from ..errors import (
    CkstoreError,
    CorruptionError,
    ObjectNotFoundError,
    ReadOnlyStoreError,
)
from ..index import ChunkRecord, PackRecord, RemoteRecord
from ..objects.codecs import FAST_CODECS, encode
from . import config
from .readers import readers_of

if TYPE_CHECKING:
    from ..engine.interfaces import ProofIndex, TierIndex
    from ..engine.repository import Repository
    from ..objects import PackWriter

log = logging.getLogger("ckstore")


@dataclass
class HealReport:
    """What :func:`heal` did: the chunks healed (id -> the remote their bytes came from), those
    no remote could give back, and the remotes that could not be opened or read (name -> why:
    a sound copy of an unrecoverable chunk may be there once they can)."""

    healed: dict[str, str] = field(default_factory=dict)
    unrecoverable: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no chunk asked about stays damaged."""
        return not self.unrecoverable

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def damaged(local: Repository, chunk_ids: Iterable[str]) -> list[str]:
    """The chunks of ``chunk_ids`` kept locally whose bytes cannot be read back verified
    against their id (a delta counts as damaged when its base is); chunks the index does not
    know or that were evicted to a remote are left out.

    Raises:
        StorageError: the store cannot be read (other than a missing pack).
    """
    index: TierIndex = local.index
    ids = sorted(set(chunk_ids))
    local.write_backs.wait(ids)  # a heal of this process still landing: judge what it leaves
    evicted = index.remote_pack_ids()
    rows = index.chunk_locations(ids)
    bad = []
    for cid in ids:
        rec = rows.get(cid)
        if rec is None or rec.pack_id in evicted:
            continue
        try:
            local.objects.read_chunk(to_location(rec, rows))
        except (CorruptionError, ObjectNotFoundError):
            bad.append(cid)
    return bad


def heal(
    local: Repository,
    chunk_ids: Iterable[str],
    remote: str | None = None,
    passed_over: set[str] | None = None,
) -> HealReport:
    """Bring back the damaged local chunks ``chunk_ids`` from ``remote`` (None: any configured
    remote that holds them), verified against their ids (module docstring). Remotes are read
    through the handles :func:`.readers.readers_of` keeps open for ``local``.

    ``passed_over``: names of remotes not to try (one that could not be opened or read is
    added): a caller healing chunk by chunk passes one set for its whole call, so a remote
    that is down costs one try, not one per chunk.

    Raises:
        ReadOnlyStoreError: ``local`` is read-only and a chunk needs healing.
        NotFoundError: ``remote`` is named and not configured.
    """
    plan = _Plan.of(local, chunk_ids, remote, passed_over)
    report = HealReport()
    if not plan.want:
        return report
    with Lease(local.index, local.lease_seconds) as lease:  # see _switch
        writer = local.objects.new_pack_writer(local.config.pack_bytes * 4)
        try:  # each chunk written as it arrives: memory stays one chunk
            for cid, name, raw in plan.arrivals(local, report):
                codec, payload = encode(raw, 1, False, fast=plan.loose)
                writer.add(cid, codec, payload, len(raw))
                report.healed[cid] = name
        except BaseException:
            writer.abort()
            raise
        report.unrecoverable = [c for c in plan.want if c not in report.healed]
        if not report.healed:
            writer.abort()
            return report
        moved = _switch(local, lease, writer, plan.old, plan.loose)
    for cid in set(report.healed) - moved:  # moved meanwhile: its new place is not ours to judge
        report.healed.pop(cid)
    if report.unrecoverable:  # a delta no remote holds reads back sound once its base healed
        report.unrecoverable = damaged(local, report.unrecoverable)
    return report


@dataclass
class Known:
    """What a caller of :func:`fetch` already looked up: the configured remotes, and the rows
    of (at least) the chunks it asks about."""

    remotes: list[RemoteRecord]
    rows: dict[str, ChunkRecord]


@dataclass
class Fetched:
    """Whole chunks :func:`fetch` brought back, verified against their ids and not yet written
    here: ``raw`` (id -> its decoded bytes), the ``report`` (remotes, and what none gave back),
    ``over`` (chunks left unfetched, past the room given), and what :func:`write_back` needs
    (the rows as they were before the fetch)."""

    raw: dict[str, memoryview]
    report: HealReport
    old: dict[str, ChunkRecord]
    loose: bool
    over: list[str] = field(default_factory=list)

    @classmethod
    def joined(cls, parts: list[Fetched]) -> Fetched:
        """Several fetches as one, for one :func:`write_back` (one pack, loose if all were)."""
        one = cls({}, HealReport(), {}, all(p.loose for p in parts))
        for p in parts:
            one.raw.update(p.raw)
            one.old.update(p.old)
            one.report.healed.update(p.report.healed)
            one.report.unrecoverable += p.report.unrecoverable
            one.report.unreachable.update(p.report.unreachable)
            one.over += p.over
        return one


def fetch(
    local: Repository,
    chunk_ids: Iterable[str],
    passed_over: set[str] | None = None,
    room: int | None = None,
    known: Known | None = None,
) -> Fetched:
    """Steps 1-2 of :func:`heal` for whole chunks (no delta chain): fetch each of
    ``chunk_ids`` from a configured remote that holds it, verified against its id, and keep its
    bytes, at most ``room`` bytes of them (None: no limit; the chunks past it, in id order, are
    not fetched: ``over``, for the caller to :func:`heal` instead). The caller uses the bytes
    at once and hands them to :func:`write_back`; until that lands the local copy is the
    damaged one and the remote still holds the chunk (a crash loses nothing). ``known``: what
    the caller looked up moments ago (the configured remotes, the chunks' rows), not asked again.

    Raises:
        ReadOnlyStoreError: ``local`` is read-only and a chunk needs healing.
    """
    plan = _Plan.of(local, chunk_ids, None, passed_over, known)
    got = Fetched({}, HealReport(), plan.old, plan.loose)
    if room is not None:
        fit: list[str] = []
        for cid in plan.want:
            size = plan.old[cid].raw_length if cid in plan.old else 0
            if size <= room:
                fit.append(cid)
                room -= size
            else:
                got.over.append(cid)
        plan.want = fit
    for cid, name, raw in plan.arrivals(local, got.report):
        got.raw[cid] = raw
        got.report.healed[cid] = name
    got.report.unrecoverable = [c for c in plan.want if c not in got.report.healed]
    return got


def write_back(local: Repository, fetched: Fetched) -> set[str]:
    """Step 3 of :func:`heal` for what :func:`fetch` brought back: the chunks written into a new
    local pack, made durable, then their rows switched, each a compare-and-swap on the row's
    place before the fetch (one gc or compaction moved meanwhile is left alone). Returns the
    ids whose rows now point at the new pack.

    Raises:
        CkstoreError: the pack could not be written or the index not updated (nothing
            switched; the local copies stay damaged and the remotes still hold the chunks).
    """
    if not fetched.raw:
        return set()
    with Lease(local.index, local.lease_seconds) as lease:  # see _switch
        writer = local.objects.new_pack_writer(local.config.pack_bytes * 4)
        try:
            for cid, raw in fetched.raw.items():
                codec, payload = encode(raw, 1, False, fast=fetched.loose)
                writer.add(cid, codec, payload, len(raw))
        except BaseException:
            writer.abort()
            raise
        return _switch(local, lease, writer, fetched.old, fetched.loose)


@dataclass
class _Plan:
    """What a heal of some chunks asks, and of whom: the chunks (``want``), the remotes to try
    in order, the rows as they were before any fetch (``old``), and whether the chunks come
    back loose."""

    want: list[str]
    records: list[RemoteRecord]
    skip: set[str]
    old: dict[str, ChunkRecord]
    loose: bool

    @classmethod
    def of(
        cls,
        local: Repository,
        chunk_ids: Iterable[str],
        remote: str | None,
        passed_over: set[str] | None,
        known: Known | None = None,
    ) -> _Plan:
        index: TierIndex = local.index
        want = sorted(set(chunk_ids))
        skip = passed_over if passed_over is not None else set()
        if not want:
            return cls([], [], skip, {}, False)
        if local.read_only:
            raise ReadOnlyStoreError(
                f"cannot heal {len(want)} damaged chunk(s) of {local.url}: {index.read_only}; "
                "healing writes a pack here"
            )
        if remote is not None:
            records = [config.get(index, remote)]
        else:
            records = known.remotes if known is not None else index.list_remotes()
        records = [r for r in records if r.name not in skip]
        # the rows to switch, as they are before the fetch
        old = known.rows if known is not None else index.chunk_locations(want)
        # loose chunks come back loose, as a take wrote them (compaction rewrites them densely)
        loose = all(old[c].codec in FAST_CODECS for c in want if c in old)
        return cls(want, records, skip, old, loose)

    def arrivals(
        self, local: Repository, report: HealReport
    ) -> Iterator[tuple[str, str, memoryview]]:
        """(id, remote, bytes) of each wanted chunk a remote gives back, verified, the remotes
        asked in order for what the earlier ones lacked (those that cannot be opened or read
        go to ``report.unreachable``)."""
        done: set[str] = set()
        for record in self.records:
            missing = [c for c in self.want if c not in done]
            if not missing:
                break
            for cid, raw in _fetch(local, record, missing, self.skip, report.unreachable):
                done.add(cid)
                yield cid, record.name, raw


def _fetch(
    local: Repository,
    record: RemoteRecord,
    chunk_ids: list[str],
    passed_over: set[str],
    unreachable: dict[str, str],
) -> Iterator[tuple[str, memoryview]]:
    """The raw bytes of the chunks of ``chunk_ids`` remote ``record`` holds, each verified
    against its id, one at a time, looked up there in one query. A remote that cannot be
    opened or read (other than a chunk damaged or missing there) gives nothing more: logged,
    its name added to ``passed_over`` and, with why, to ``unreachable``."""
    readers = readers_of(local)
    try:
        there = readers.get(record)
        theirs: ProofIndex = there.index
        rows = theirs.chunk_locations(chunk_ids)
        for cid in chunk_ids:
            rec = rows.get(cid)
            if rec is None:
                continue
            try:  # decoded there and hashed against the id asked for, not the remote's word
                raw = memoryview(there.objects.read_chunk(to_location(rec, rows)))
            except (CorruptionError, ObjectNotFoundError) as exc:
                log.warning("chunk %s is damaged at remote %r too: %s", cid, record.name, exc)
                continue
            yield cid, raw
    except CkstoreError as exc:
        log.warning("cannot heal from remote %r: %s", record.name, exc)
        passed_over.add(record.name)
        unreachable[record.name] = f"{type(exc).__name__}: {exc}"
        readers.forget(record.name)


def _switch(
    local: Repository,
    lease: Lease,
    writer: PackWriter,
    old: dict[str, ChunkRecord],
    loose: bool,
) -> set[str]:
    """Make the new pack (``loose``: of loose chunks) durable, then switch the rows of its
    chunks to it, per old pack (each a compare-and-swap on the row's old place); returns the
    ids whose rows were switched. The pack is written and recorded inside ``lease``'s write
    session, which ends here: a gc beside sees a writer alive and does not take the pack for
    an orphan before it is recorded; an expired session records nothing."""
    index: TierIndex = local.index
    done = writer.finish()  # durable first...
    assert done is not None
    new_id, size, locs = done
    by_pack: dict[str, list[ChunkRecord]] = defaultdict(list)
    for rec in to_records(locs):
        before = old.get(rec.chunk_id)
        if before is not None:
            by_pack[before.pack_id].append(rec)
    switched: set[str] = set()
    for old_pack, moves in by_pack.items():  # ...then rows, each a compare-and-swap
        if lease.error is not None:
            raise lease.error
        pack = PackRecord(new_id, size, len(locs), time.time(), loose)
        if index.relocate_chunks(pack, moves, old_pack, lease.id):
            now = index.chunk_locations([m.chunk_id for m in moves])
            switched |= {m.chunk_id for m in moves if now[m.chunk_id].pack_id == new_id}
    index.end_session(lease.id, "committed")  # nothing to commit: its pack is recorded
    lease.committed = True
    return switched
