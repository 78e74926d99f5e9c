"""Compaction: rewrite older snapshots' loose chunks densely, as ``git gc`` packs loose objects.

A take writes its new chunks *loose* (``codecs.FAST_CODECS``: raw by default, ``exp-zstd`` for
floats with ``take_codec="fast"``; no deltas) into packs the index marks loose, so a training
job waits as little as possible. Compaction later rewrites the loose chunks that no *newest*
snapshot of a run uses (the ``keep_loose`` newest of each run stay loose, so a resume reads the
fast form):

1. **Plan** (``_compact_plan``; index and manifests only): the loose chunks outside every
   run's newest snapshots, in the order of the oldest snapshot that uses them (one dropped by a
   gc meanwhile is skipped); for each, a delta base candidate: the chunk at the same place (key,
   dtype, shape, grid box) in that snapshot's parent, the run's snapshot before it, as a take
   with ``delta_base="parent"`` would use.
2. **Bases** (``_compact_plan``): decided bases first; a chunk whose candidate chain leads
   back to it gets no base (takes that commit out of the order they started in make a parent
   newer than its child), a candidate at ``delta_depth`` is replaced by its ancestor one link
   shallower (keyframes, as for takes), a chunk some delta already uses as its base stays whole
   (its dependents' chains must not grow); the bases chosen are pinned to this compaction's
   write session, so no gc prunes one meanwhile.
3. **Rewrite**, on the repository's threads: each chunk (and its base) is read and verified
   against its id, then encoded densely: an XOR delta against the base when that is smaller,
   else ``bytegroup-zstd`` / ``zstd`` whole. **Verify before the drop**: the new payload is
   decoded as a reader will decode it (its codec and raw length as recorded, a delta XORed onto
   the base's verified bytes) and compared with the chunk's bytes as read (verified against its
   id), before it goes into a pack; one that does not decode back (an encoder bug, a flipped
   bit in its output buffer, a delta taken against other bytes than its base) is refused, the
   chunk stays loose and the report counts it (``encodings_refused``), so neither the index
   switch nor the loose pack's deletion ever depends on an unchecked payload (restic checks
   packs before upload; git's repack keeps a CRC rule).
4. **Switch**: each dense pack is made durable, then one index transaction points its chunks'
   rows at it (compare-and-swap on the loose pack: a chunk gc pruned or moved meanwhile is left
   alone, and so is a delta whose base another compaction changed meanwhile); loose packs left
   without chunks are retired and deleted at once (rows first, then objects). A reader that
   located a chunk in one of them finds the pack gone and looks the chunk up again
   (docs/RELIABILITY.md, I4), so the disk holds each state once, not twice, while the grace
   period of gc's own repacks runs.

A crash at any point leaves every snapshot readable: before the switch the new pack is an
orphan gc removes; after it the old pack is garbage. Chunk ids never change, so takes that
dedup against a chunk being compacted, and snapshots that reference it, are unaffected.

``auto_compact.py`` runs it behind training after takes (``git gc --auto``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .. import objects
from ..engine.background import polite_pool
from ..engine.lease import Lease
from ..engine.locations import to_location, to_records
from ..errors import CorruptionError, InvalidInputError, ObjectNotFoundError
from ..index import ChunkRecord, PackRecord
from ..objects.delta import xor_into
from ._compact_plan import Job, hot, plan, resolve_bases
from .defaults import DEFAULT_KEEP_LOOSE as DEFAULT_KEEP_LOOSE

if TYPE_CHECKING:
    from ..engine.interfaces import CompactIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")


@dataclass
class CompactReport:
    """What a compaction did (or, with ``dry_run``, would do)."""

    dry_run: bool
    keep_loose: int = DEFAULT_KEEP_LOOSE
    snapshots: int = 0
    """Snapshots whose loose chunks were rewritten."""
    chunks: int = 0
    """Chunks rewritten densely."""
    raw_bytes: int = 0
    loose_bytes: int = 0
    """What those chunks took loose..."""
    dense_bytes: int = 0
    """...and what they take now (with ``dry_run``: 0, nothing was encoded)."""
    delta_chunks: int = 0
    packs_written: int = 0
    packs_retired: int = 0
    """Loose packs left without chunks..."""
    packs_deleted: int = 0
    """...and deleted (at once: readers look a chunk up again when its pack is gone)."""
    encodings_refused: int = 0
    """Chunks whose new payload did not decode back to their bytes (left loose, logged)."""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time it used (its own thread and the encoding threads; waits for takes excluded)."""
    check_cpu_seconds: float = 0.0
    """Of ``cpu_seconds``, what decoding each new payload to check it took."""

    @property
    def saved_bytes(self) -> int:
        return self.loose_bytes - self.dense_bytes if not self.dry_run else 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saved_bytes": self.saved_bytes}


def compact(
    repo: Repository,
    *,
    keep_loose: int = DEFAULT_KEEP_LOOSE,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    pause: Callable[[], bool] | None = None,
    stop: Callable[[], bool] | None = None,
    young: AbstractSet[str] = frozenset(),
) -> CompactReport:
    """Rewrite the loose chunks that no newest snapshot of a run uses densely (module docstring).

    Args:
        repo: the repository.
        keep_loose: newest snapshots of each run whose chunks stay loose (at least 0).
        young: snapshots whose chunks stay loose too (what this process's deletions show
            its retention is about to drop, ``engine/deletion_ages.py``).
        dry_run: plan and report, write nothing.
        progress: called with the raw bytes of each chunk rewritten.
        pause: polled between chunks; while it returns True, compaction waits (another
            operation of this process wants the CPU). Given, compaction runs behind training:
            on ``repo.background_threads`` workers at the lowest CPU priority.
        stop: polled between chunks; once it returns True, compaction ends after switching
            what it has written (the rest stays loose for the next compaction).
    """
    index: CompactIndex = repo.index
    repo.write_backs.wait()  # healed chunks land before compaction reads them
    t0, c0 = time.perf_counter(), time.thread_time()
    report = CompactReport(dry_run=dry_run, keep_loose=keep_loose)
    jobs, snaps = plan(repo, keep_loose, young)
    report.snapshots = snaps
    report.loose_bytes = sum(j.rec.length for j in jobs)
    report.raw_bytes = sum(j.rec.raw_length for j in jobs)
    if dry_run or not jobs:
        report.chunks = len(jobs)
        report.seconds = time.perf_counter() - t0
        return report
    with Lease(index, repo.lease_seconds) as lease:
        jobs = resolve_bases(repo, lease.id, jobs)
        _rewrite(repo, lease, jobs, report, progress, pause, stop)
        index.end_session(lease.id, "committed")  # nothing to commit: ending it drops its pins
        lease.committed = True
    report.seconds = time.perf_counter() - t0
    report.cpu_seconds += time.thread_time() - c0
    return report


def loose_pending(
    repo: Repository,
    keep_loose: int = DEFAULT_KEEP_LOOSE,
    young: AbstractSet[str] = frozenset(),
) -> bool:
    """Whether any loose chunk lies outside every run's newest ``keep_loose`` snapshots and
    the snapshots ``young`` names: what an automatic compaction is started for. Reads the
    index only."""
    index: CompactIndex = repo.index
    loose = {c.chunk_id for c in index.loose_chunks() if c.codec in objects.FAST_CODECS}
    return bool(loose - hot(index, keep_loose, young))


# --- 3. rewrite, 4. switch -----------------------------------------------------------------------
def _rewrite(
    repo: Repository,
    lease: Lease,
    jobs: list[Job],
    report: CompactReport,
    progress: Callable[[int], None] | None,
    pause: Callable[[], bool] | None,
    stop: Callable[[], bool] | None,
) -> None:
    writer = repo.objects.new_pack_writer(repo.config.pack_bytes)
    batch: list[tuple[Job, int]] = []  # (job, depth) in the pack being filled
    window: deque[tuple[Job, Future[tuple[str, bytes, float, float]]]] = deque()
    behind = pause is not None  # behind training: polite workers (engine/background.py)
    threads = max(1, repo.background_threads if behind else repo.threads)
    with (
        polite_pool(threads, "ckstore-compact")
        if behind
        else ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckstore-compact")
    ) as pool:
        todo = iter(jobs)
        try:
            while True:
                while len(window) < 2 * threads:
                    job = next(todo, None)
                    if job is None or (stop is not None and stop()):
                        break
                    _wait(pause)
                    window.append((job, pool.submit(_encode, repo, job, pause)))
                if not window:
                    break
                job, fut = window.popleft()
                try:
                    codec, payload, cpu, checked = fut.result()
                    report.cpu_seconds += cpu
                    report.check_cpu_seconds += checked
                except EncodingRefused as exc:  # it stays loose, whole and readable
                    report.encodings_refused += 1
                    log.error("ckstore: %s", exc)
                    continue
                except (
                    CorruptionError,
                    ObjectNotFoundError,
                ) as exc:  # it stays loose; check names it
                    log.warning(
                        "ckstore: compaction left chunk %s loose: %s", job.rec.chunk_id, exc
                    )
                    continue
                delta = objects.is_delta(codec)
                writer.add(
                    job.rec.chunk_id,
                    codec,
                    payload,
                    job.rec.raw_length,
                    job.base_id if delta else None,
                )
                batch.append((job, job.base.depth + 1 if delta and job.base is not None else 0))
                report.delta_chunks += delta
                if progress is not None:
                    progress(job.rec.raw_length)
                if writer.full:
                    _wait(pause)  # its fsync and index transaction wait for the take too
                    _switch(repo, lease, writer, batch, report)
                    writer, batch = repo.objects.new_pack_writer(repo.config.pack_bytes), []
            _switch(repo, lease, writer, batch, report)
        except BaseException:
            writer.abort()  # the pack being filled leaves no staging file (those switched stay)
            for _, fut in window:
                fut.cancel()
            raise


class EncodingRefused(CorruptionError):
    """A chunk's new payload did not decode back to the chunk (it stays loose)."""


def _encode(
    repo: Repository, job: Job, pause: Callable[[], bool] | None = None
) -> tuple[str, bytes, float, float]:
    """Read and verify the chunk (and its base), encode it densely (a delta if smaller) and
    check the payload (:func:`_check`); a job queued while the process is busy (``pause``)
    starts once it is not. Also returns the CPU seconds this thread spent on it, and of them
    on the check.

    Raises:
        EncodingRefused: the payload does not decode back to the chunk.
    """
    _wait(pause)
    c0 = time.thread_time()
    raw = _read(repo, job.rec, {})
    base = None
    if job.base is not None:
        base = _read(repo, job.base, job.base_known)
        codec, payload = objects.encode_delta(
            raw, base, job.itemsize, job.grouped, plain_estimate=job.rec.length
        )
    else:
        codec, payload = objects.encode(raw, job.itemsize, job.grouped)
    out = bytes(payload)
    c1 = time.thread_time()
    _check(job, codec, out, raw, base if objects.is_delta(codec) else None)
    c2 = time.thread_time()
    return codec, out, c2 - c0, c2 - c1


def _check(job: Job, codec: str, payload: bytes, raw: Any, base: Any) -> None:
    """Decode ``payload`` as a reader will (``codec``, the chunk's raw length, and for a delta
    the verified bytes of the base its row will name) and compare with ``raw``, the chunk's
    bytes as read and verified against its id: equal bytes are the chunk.

    Raises:
        EncodingRefused: they differ, or the payload does not decode.
    """
    cid = job.rec.chunk_id
    try:
        got: Any = objects.decode(codec, payload, job.rec.raw_length)
        if base is not None:
            got = bytearray(got)
            xor_into(got, base)
    except (CorruptionError, InvalidInputError) as exc:
        raise EncodingRefused(
            f"compaction refused its {codec} encoding of chunk {cid}: it does not decode "
            f"({exc}); the chunk stays loose, as it was"
        ) from exc
    if not _same_bytes(got, raw):
        against = f" against base {job.base_id}" if base is not None else ""
        raise EncodingRefused(
            f"compaction refused its {codec} encoding{against} of chunk {cid}: it decodes to "
            "other bytes than the chunk's (an encoder fault); the chunk stays loose, as it was"
        )


def _same_bytes(a: Any, b: Any) -> bool:
    import numpy as np  # here: reading an index never loads numpy

    x = np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)
    y = np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def _read(repo: Repository, rec: ChunkRecord, known: dict[str, ChunkRecord]) -> Any:
    """The verified raw bytes of ``rec``'s chunk; looked up again if its pack is gone (this
    compaction, or another, switched it and deleted the loose pack: a base rewritten earlier in
    the same run, typically)."""
    index: CompactIndex = repo.index
    try:
        return repo.objects.read_chunk(to_location(rec, known))
    except ObjectNotFoundError:
        now = index.chunk_locations([rec.chunk_id])
        if rec.chunk_id not in now or now[rec.chunk_id].pack_id == rec.pack_id:
            raise
        return repo.objects.read_chunk(to_location(now[rec.chunk_id], now))


def _switch(
    repo: Repository,
    lease: Lease,
    writer: objects.PackWriter,
    batch: list[tuple[Job, int]],
    report: CompactReport,
) -> None:
    """Make the pack durable, point its chunks' rows at it, retire the loose packs emptied."""
    index: CompactIndex = repo.index
    done = writer.finish()
    if done is None:
        return
    if lease.error is not None:
        raise lease.error
    pack_id, size, locs = done
    depths = {job.rec.chunk_id: depth for job, depth in batch}
    old = {job.rec.chunk_id: job.rec.pack_id for job, _ in batch}
    moves = [(rec, old[rec.chunk_id]) for rec in to_records(locs, depths)]
    switched = set(
        index.rewrite_chunks(lease.id, PackRecord(pack_id, size, len(moves), time.time()), moves)
    )
    report.packs_written += 1
    report.chunks += len(switched)
    report.dense_bytes += sum(rec.length for rec, _ in moves if rec.chunk_id in switched)
    retired = index.retire_packs(set(old.values()))
    report.packs_retired += len(retired)
    # Deleted at once, rows first: a reader that located a chunk in one of them finds the pack
    # gone and looks the chunk up again (I4); the disk holds each state once, not twice.
    for pack_id in index.delete_retired_packs(time.time(), only=retired):
        repo.objects.delete_pack(pack_id)
        report.packs_deleted += 1


def _wait(pause: Callable[[], bool] | None) -> None:
    while pause is not None and pause():
        time.sleep(0.05)
