"""Copy the chunks one store lacks from another: the byte-moving half of a push or a pull.

:func:`copy_chunks` runs inside a write session of the destination (as a take does):

1. **Negotiate.** Ask the destination's index which of the chunk ids it has, in batches, pinning
   the ones it reports in the same transaction (``Index.lookup_chunks``): those are never sent,
   and no gc there can prune them before the snapshot that needs them commits.
2. **Read.** The missing chunks are read from the source's packs in large ranged reads (the
   payloads of one pack that lie close together go in one read), on ``io_threads`` threads.
   Every payload is checked before it goes anywhere. A payload of this store's own (a push) is
   checked against the digest its writer recorded (``payload_digest``, index revision 0003).
   A payload of the other store (a pull, a clone), or one this store's rows point at there
   (evicted), is decoded and hashed against its chunk id (:mod:`ckstore.objects.received`; a
   delta onto this store's verified copy of its base): a digest the other store supplies is
   never trusted. A damaged payload raises ``CorruptionError`` naming the chunk, its pack and
   the store it was read from; nothing of the snapshot is committed.
3. **Write.** Payloads go into the destination's packs *as they are stored* (same codec: a
   take's loose ``exp-zstd`` chunk arrives loose, a compacted one dense), so a push costs no
   encoding. A delta goes as a delta only when the destination holds its base already (pinned
   by the same negotiation) at no greater chain depth than here; otherwise its bytes are read
   through its chain, verified, and sent whole, densely encoded: the destination never needs a
   base it was not sent. Each full pack is made durable, then recorded (``add_pack``, which pins
   its chunks): the destination's crash-ordering rule for a take.

A chunk that moves at the source meanwhile (compaction or gc rewrote it, or the local tier
evicted it) is looked up again and sent whole from its new place. Chunk ids never change, so
nothing already sent is ever sent again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine.locations import to_location, to_records
from ..errors import CorruptionError, NotFoundError, ObjectNotFoundError
from ..format.dtypes import GROUPED, itemsize
from ..format.manifest import Manifest, PerRankEntry, TensorEntry
from ..index import ChunkRecord, PackRecord
from ..objects.hashing import payload_digest
from ..objects.received import matches_id

if TYPE_CHECKING:
    from ..engine.interfaces import InventoryIndex, LocationIndex, WriteIndex
    from ..engine.repository import Repository

SEGMENT_BYTES = 16 << 20
"""Largest ranged read of a source pack (payloads that lie close together share one)."""
GAP_BYTES = 1 << 20
"""Bytes of payloads not wanted that a read may span to join two wanted ones."""


@dataclass
class CopyStats:
    """What a copy moved (summed over the snapshots of a transfer)."""

    chunks_sent: int = 0
    bytes_sent: int = 0
    """Stored (encoded) bytes of the chunks written to the destination."""
    chunks_skipped: int = 0
    bytes_skipped: int = 0
    """Stored bytes (at the source) of the chunks the destination had already."""
    chunks_whole: int = 0
    """Deltas sent whole, their base not at the destination (counted in chunks_sent too)."""
    packs_written: int = 0
    bytes_read: int = 0
    """Bytes read from the source's packs."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, **figures: int) -> None:
        """Add to the figures (from any thread)."""
        with self.lock:
            for name, n in figures.items():
                setattr(self, name, getattr(self, name) + n)

    def to_dict(self) -> dict[str, int]:
        return {
            k: getattr(self, k)
            for k in (
                "chunks_sent",
                "bytes_sent",
                "chunks_skipped",
                "bytes_skipped",
                "chunks_whole",
                "packs_written",
                "bytes_read",
            )
        }


@dataclass
class Shape:
    """How a chunk's elements look (what a dense encoding of it needs)."""

    itemsize: int = 1
    grouped: bool = False


def shapes_of(manifest: Manifest) -> dict[str, Shape]:
    """Chunk id -> the element size of the tensor it belongs to, for every chunk of ``manifest``."""
    out: dict[str, Shape] = {}
    for entry in manifest.entries.values():
        tensors = (
            [entry]
            if isinstance(entry, TensorEntry)
            else list(entry.tensors())
            if isinstance(entry, PerRankEntry)
            else []
        )
        for t in tensors:
            if t.inline:
                continue
            shape = Shape(itemsize(t.dtype), t.dtype in GROUPED)
            for c in t.chunks:
                out.setdefault(c.id, shape)
    return out


@dataclass
class _Job:
    """One chunk to send: its source row (with its chain) and how it goes."""

    rec: ChunkRecord
    loc: objects.ChunkLocation
    shape: Shape
    base_depth: int | None = None
    """Its base's depth at the destination when it goes as a delta; None: it goes whole."""


@dataclass
class _Segment:
    """One ranged read of a source pack covering the payloads of ``jobs``."""

    pack_id: str
    start: int
    end: int
    jobs: list[_Job] = field(default_factory=list)


class ChunkCopier:
    """Copies chunks from ``src`` to ``dst`` within the destination session ``session``.

    ``where`` names what is copied in errors (``"snapshot sft@100 (0123...)"``); ``pause`` is
    polled between reads (a background push waits while the process takes or restores);
    ``progress`` is called with the stored bytes of each chunk sent or found there already.
    ``ours`` is this store (``src`` for a push, ``dst`` for a pull): only its own payload
    digests are trusted, and a delta that arrives is decoded onto its copy of the base.
    """

    def __init__(
        self,
        src: Repository,
        dst: Repository,
        session: str,
        where: str,
        stats: CopyStats,
        pause: Callable[[], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        ours: Repository | None = None,
    ) -> None:
        self.src, self.dst, self.session, self.where = src, dst, session, where
        self.src_index: LocationIndex = src.index
        self.dst_index: WriteIndex = dst.index
        self.stats, self.pause, self.progress = stats, pause, progress
        self.ours = ours if ours is not None else src
        self.ours_index: LocationIndex = self.ours.index
        self.remote_packs = _evicted_packs(src) if self.ours is src else set()
        self.threads = max(1, src.io_threads)

    # --- 1. negotiate ----------------------------------------------------------------------
    def copy(self, chunk_ids: set[str], shapes: dict[str, Shape]) -> None:
        """Send every chunk of ``chunk_ids`` the destination lacks; return once all are
        durable there and recorded (pinned to the session)."""
        have = self.dst_index.lookup_chunks(self.session, sorted(chunk_ids))
        missing = sorted(chunk_ids - have.keys())
        if have:
            self._skipped(chunk_ids & have.keys())
        if missing:
            self._send(self._jobs(missing, shapes))

    def _skipped(self, ids: set[str]) -> None:
        rows = self.src_index.chunk_locations(ids)
        size = sum(rows[c].length for c in ids if c in rows)
        self.stats.count(chunks_skipped=len(ids), bytes_skipped=size)
        if self.progress is not None:
            self.progress(size)

    def _jobs(self, missing: list[str], shapes: dict[str, Shape]) -> list[_Job]:
        known = self.src_index.chunk_locations(missing)
        lost = [c for c in missing if c not in known]
        if lost:
            raise NotFoundError(
                f"{self.where}: chunk {lost[0]} ({len(lost)} in all) is not in the index of {self.src.url}: the "
                "snapshot was deleted there while it was being sent, or that index is damaged (`ckstore check`)"
            )
        bases = {known[c].base_id for c in missing if known[c].base_id is not None}
        at_dst = (
            self.dst_index.lookup_chunks(self.session, sorted(b for b in bases if b is not None))
            if bases
            else {}
        )
        jobs = []
        for cid in missing:
            rec = known[cid]
            job = _Job(rec, to_location(rec, known), shapes.get(cid, Shape()))
            base = at_dst.get(rec.base_id) if rec.base_id is not None else None
            if base is not None and known[rec.base_id].depth >= base.depth:  # type: ignore[index]
                job.base_depth = base.depth
            jobs.append(job)
        return jobs

    # --- 2. read, 3. write -----------------------------------------------------------------
    def _send(self, jobs: list[_Job]) -> None:
        segments = _segments([j for j in jobs if j.rec.base_id is None or j.base_depth is not None])
        whole = [j for j in jobs if j.rec.base_id is not None and j.base_depth is None]
        sink = _Sink(self.dst, self.session, self.stats, self.threads)
        try:
            with ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix="ckstore-push"
            ) as pool:
                tasks: Iterator[Callable[[], list[tuple[_Job, str, Any]]]] = iter(
                    [
                        *(partial(self._read_segment, seg) for seg in segments),
                        *(partial(self._whole_list, j) for j in whole),
                    ]
                )
                window: deque[Future[list[tuple[_Job, str, Any]]]] = deque()
                while True:
                    while len(window) < self.threads + 1:
                        task = next(tasks, None)
                        if task is None:
                            break
                        while self.pause is not None and self.pause():
                            time.sleep(0.05)
                        window.append(pool.submit(task))
                    if not window:
                        break
                    for job, codec, payload in window.popleft().result():
                        sink.add(job, codec, payload)
                        if self.progress is not None:
                            self.progress(job.rec.length)
            sink.close()
        except BaseException:
            sink.abort()
            raise

    def _whole_list(self, job: _Job) -> list[tuple[_Job, str, Any]]:
        return [self._whole(job)]

    def _read_segment(self, seg: _Segment) -> list[tuple[_Job, str, Any]]:
        """The checked payloads of one segment, as stored (a chunk moved meanwhile: whole)."""
        name = objects.pack_name(seg.pack_id)
        try:
            data = memoryview(self.src.objects.backend.get(name, seg.start, seg.end - seg.start))
        except ObjectNotFoundError:
            return [self._whole(j, moved=True) for j in seg.jobs]
        self.stats.count(bytes_read=len(data))
        out = []
        for j in seg.jobs:
            payload = data[j.rec.offset - seg.start : j.rec.offset - seg.start + j.rec.length]
            self._check(j, payload)
            out.append((j, j.rec.codec, payload))
        return out

    def _check(self, job: _Job, payload: memoryview) -> None:
        """A payload of this store's own is checked against the digest its writer recorded; one
        of the other store (a pull), or one this store points at there (evicted), is decoded
        (a delta onto this store's verified copy of its base) and hashed against its id."""
        rec = job.rec
        if self._own_digest(rec):
            ok = (
                payload_digest(payload, rec.chunk_id, rec.codec, rec.raw_length, rec.base_id)
                == rec.payload_digest
            )
        elif rec.base_id is None:
            ok = matches_id(rec.chunk_id, rec.codec, payload, rec.raw_length)
        else:
            ok = matches_id(
                rec.chunk_id, rec.codec, payload, rec.raw_length, self._our_base(rec.base_id)
            )
        if not ok:
            raise self._damaged(rec)

    def _own_digest(self, rec: ChunkRecord) -> bool:
        return (
            self.src is self.ours
            and rec.payload_digest is not None
            and rec.pack_id not in self.remote_packs
        )

    def _our_base(self, base_id: str) -> Any:
        """The verified raw bytes of chunk ``base_id`` as this store holds them."""
        rows = self.ours_index.chunk_locations([base_id])
        if base_id not in rows:
            raise NotFoundError(
                f"{self.where}: delta base {base_id} left {self.ours.url} while it was used"
            )
        return self.ours.objects.read_chunk(to_location(rows[base_id], rows))

    def _damaged(self, rec: ChunkRecord) -> CorruptionError:
        return CorruptionError(
            f"{self.where}: chunk {rec.chunk_id} in pack {rec.pack_id} of {self.src.url} is damaged (its stored "
            f"payload does not decode to the bytes of its id, or is not the one its writer recorded); nothing "
            f"of the snapshot was committed at {self.dst.url}. "
            f"Run `ckstore check --read-data` on {self.src.url}"
        )

    def _read_verified(self, loc: objects.ChunkLocation) -> Any:
        try:
            return self.src.objects.read_chunk(loc)
        except CorruptionError as exc:
            raise CorruptionError(
                f"{self.where}: {exc}; nothing of the snapshot was committed at {self.dst.url}. "
                f"Run `ckstore check --read-data` on {self.src.url}"
            ) from exc

    def _whole(self, job: _Job, moved: bool = False) -> tuple[_Job, str, Any]:
        """The chunk read through its chain (verified against its id) and densely encoded:
        a delta whose base the destination lacks, or a chunk found moved at the source."""
        loc = job.loc
        for attempt in range(3):
            try:
                raw = self._read_verified(loc)
                break
            except ObjectNotFoundError:
                if attempt == 2:
                    raise
                loc = self._relocate(job)
        codec, payload = objects.encode(raw, job.shape.itemsize, job.shape.grouped)
        job.base_depth = None
        job.rec = ChunkRecord(
            job.rec.chunk_id,
            job.rec.pack_id,
            job.rec.offset,
            len(payload),
            job.rec.raw_length,
            codec,
        )
        self.stats.count(chunks_whole=1)
        return job, codec, bytes(payload)

    def _relocate(self, job: _Job) -> objects.ChunkLocation:
        known = self.src_index.chunk_locations([job.rec.chunk_id])
        if job.rec.chunk_id not in known:
            raise NotFoundError(
                f"{self.where}: chunk {job.rec.chunk_id} left {self.src.url} while it was being "
                "sent (its snapshot was deleted there)"
            )
        return to_location(known[job.rec.chunk_id], known)


def _segments(jobs: list[_Job]) -> list[_Segment]:
    """Group jobs by pack into reads of at most :data:`SEGMENT_BYTES`, joining payloads at most
    :data:`GAP_BYTES` apart, in pack and offset order."""
    out: list[_Segment] = []
    for j in sorted(jobs, key=lambda j: (j.rec.pack_id, j.rec.offset)):
        end = j.rec.offset + j.rec.length
        last = out[-1] if out else None
        if (
            last is not None
            and last.pack_id == j.rec.pack_id
            and j.rec.offset - last.end <= GAP_BYTES
            and end - last.start <= SEGMENT_BYTES
        ):
            last.end = max(last.end, end)
            last.jobs.append(j)
        else:
            out.append(_Segment(j.rec.pack_id, j.rec.offset, end, [j]))
    return out


def _evicted_packs(src: Repository) -> set[str]:
    """The packs of a remote that rows of ``src`` point at (its evicted chunks): their digests
    came from that remote, so payloads there are checked against their ids."""
    index: InventoryIndex = src.index
    return set(index.remote_pack_ids())


class _Sink:
    """The destination's packs: filled in order, each full one made durable and recorded on a
    thread of its own (at most ``threads`` at once)."""

    def __init__(self, dst: Repository, session: str, stats: CopyStats, threads: int) -> None:
        self.dst, self.session, self.stats = dst, session, stats
        self._index: WriteIndex = dst.index
        self.writer = dst.objects.new_pack_writer(dst.config.pack_bytes)
        self.depths: dict[str, int] = {}
        self.loose = False
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckstore-push-put")
        self.pending: deque[Future[None]] = deque()
        self.threads = threads

    def add(self, job: _Job, codec: str, payload: Any) -> None:
        delta = job.base_depth is not None
        self.writer.add(
            job.rec.chunk_id, codec, payload, job.rec.raw_length, job.rec.base_id if delta else None
        )
        self.depths[job.rec.chunk_id] = job.base_depth + 1 if job.base_depth is not None else 0
        self.loose |= codec in objects.FAST_CODECS
        self.stats.count(chunks_sent=1, bytes_sent=memoryview(payload).nbytes)
        if self.writer.full:
            self._flush()

    def _flush(self) -> None:
        writer, depths, loose = self.writer, self.depths, self.loose
        self.writer, self.depths, self.loose = (
            self.dst.objects.new_pack_writer(self.dst.config.pack_bytes),
            {},
            False,
        )
        while len(self.pending) >= self.threads:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._put, writer, depths, loose))

    def _put(self, writer: objects.PackWriter, depths: dict[str, int], loose: bool) -> None:
        done = writer.finish()  # durable first...
        if done is None:
            return
        pack_id, size, locs = done
        records = to_records(locs, depths)
        self._index.add_pack(
            self.session, PackRecord(pack_id, size, len(records), time.time(), loose=loose), records
        )
        self.stats.count(packs_written=1)  # ...then recorded

    def close(self) -> None:
        self._flush()
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True)

    def abort(self) -> None:
        self.writer.abort()
        for fut in self.pending:
            fut.cancel()
        self.pool.shutdown(wait=True)
