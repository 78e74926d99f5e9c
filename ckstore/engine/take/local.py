"""One process's part of a take: a write session, workers, the chunks it stores, the commit.

Every way of taking a snapshot goes through :class:`LocalTake`: a take in one process (now or
in the background), an import, each rank of a distributed take and each rank of a DCP save.
What differs between them is only which chunks a process stores and whether it commits::

    with LocalTake(repo, spec) as t:          # a write session with a lease (I4)
        t.store(chunks)                       # hash, pin what the store has, write the rest
        manifest = t.manifest(apps, entries)  # the spec's labels, this take's session
        record = t.commit(manifest)           # or t.hand_over(), on a rank that does not commit

Leaving the ``with`` block without a commit or a hand-over aborts the session: its pins are
dropped and what it wrote becomes garbage for gc. Packs are durable before they are indexed,
and the manifest before the commit names it (I1).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...errors import InvalidInputError, NotFoundError
from ...format.manifest import Entry, Manifest
from ...index import ChunkRecord, EntryRecord, PackRecord, SnapshotRecord
from ..background import lower_priority, polite_pool
from ..lease import Lease
from ..progress import Meter, ProgressFn, meter
from ..repository import Repository
from .commit import commit_manifest, put_manifest, snapshot_record
from .deltas import resolve_bases
from .device_staging import DeviceStager
from .guard import Summed, TakeGuard, remember
from .packing import Chunk, PackPipeline, TakeOptions, WriteStats, batches
from .spec import TakeSpec

if TYPE_CHECKING:
    from ..interfaces import WriteIndex

HASH_BATCH_BYTES = 128 << 20
"""A take hashes and looks up chunks in batches of about this many bytes..."""
HASH_BATCH_CHUNKS = 4096
"""...or of at most this many chunks."""
RATE_MIN_BYTES = 16 << 20
"""A store of at least this many bytes at normal priority measures the repository's
``persist_rate`` (what an async take's part past its staging budget will block for)."""
FIRST_BATCH_BYTES = 16 << 20
"""The first batch is this small (each next one twice the last), so encoding and pack writes
start early instead of after a whole batch was hashed."""


@dataclass
class TakeStats(WriteStats):
    """What a take stored: the pack writer's figures, and the chunks the store already had."""

    reused_chunks: int = 0
    written_raw_bytes: int = 0
    """Raw bytes of the chunks this take had to write (the store lacked them)."""

    def add(self, other: WriteStats) -> None:
        for name in ("new_bytes", "new_chunks", "delta_chunks", "delta_raw_bytes", "delta_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def figures(self) -> dict[str, int]:
        """The figures a commit records (and a distributed take gathers from every rank)."""
        return {
            "new_bytes": self.new_bytes,
            "new_chunks": self.new_chunks,
            "reused_chunks": self.reused_chunks,
        }


class LocalTake:
    """This process's part of one take into ``repo``, as ``spec`` describes it.

    Args:
        repo: the repository written to.
        spec: the take's description; its labels are what :meth:`manifest` and :meth:`commit`
            record.
        opts: the knobs (default: the repository's, with deltas on when ``spec`` has a base).
    """

    def __init__(
        self,
        repo: Repository,
        spec: TakeSpec,
        opts: TakeOptions | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.repo = repo
        self.spec = spec
        self.opts = opts or TakeOptions.of(repo, deltas=spec.delta_base is not None)
        self.index: WriteIndex = repo.index
        self.started = time.time()
        self.stats = TakeStats()
        self._seen: set[str] = set()  # chunk ids handled by this take
        self._deferred: list[
            tuple[PackRecord, list[ChunkRecord]]
        ] = []  # durable, recorded at commit
        self._found_manifests: dict[str, bytes] = {}  # stored, not written: found in place
        self._progress = progress
        self._meter: Meter | None = None
        self.guard = TakeGuard(spec, repo)
        """Health figures while hashing, staleness and the policies (``engine/take/guard.py``)."""
        self._lease: Lease | None = None
        self._staging: Lease | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: deque[Any] = deque()  # encode buffers, shared by every store() call
        self._activity = ExitStack()

    # --- the session ------------------------------------------------------------------------
    def open(self) -> LocalTake:
        """Begin the write session (its lease beats until :meth:`close`) and the workers."""
        self.repo.forget_manifest()  # a training job's resume does not keep its manifest
        self._activity.enter_context(self.repo.activity())  # background compaction waits meanwhile
        self._pool = self._new_pool()
        try:
            self._lease = Lease(self.repo.index, self.opts.lease_seconds, eager=False).__enter__()
        except BaseException:
            self._pool.shutdown()
            self._activity.close()
            raise
        return self

    def close(self) -> None:
        """End the session: aborted unless committed or handed over. Idempotent."""
        lease, self._lease = self._lease, None
        staging, self._staging = self._staging, None
        pool, self._pool = self._pool, None
        try:
            if staging is not None:
                staging.__exit__(None, None, None)
            if lease is not None:
                lease.__exit__(None, None, None)
        finally:
            if pool is not None:
                pool.shutdown()
            self._activity.close()

    def behind_training(self, threads: int) -> None:
        """Run the rest of the take as work behind training: on ``threads`` workers at the
        lowest CPU priority, pack writes too (``engine/background.py``); call it from the
        thread that goes on with the take, which is lowered as well. A take's blocking part
        (what a caller waits for) runs before, on the full ``threads`` at normal priority."""
        lower_priority()
        direct = self.opts.direct or self.repo.direct_writes == "background"
        self.opts = replace(self.opts, threads=threads, polite=True, direct=direct)
        if self._pool is not None:
            old, self._pool = self._pool, self._new_pool()
            old.shutdown()

    def _new_pool(self) -> ThreadPoolExecutor:
        if self.opts.polite:
            return polite_pool(self.opts.threads, "ckstore")
        return ThreadPoolExecutor(max_workers=self.opts.threads, thread_name_prefix="ckstore")

    def __enter__(self) -> LocalTake:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def session(self) -> str:
        """The write session's id (its pins keep what this take uses)."""
        return self._live_lease().id

    def check_lease(self) -> None:
        """Raise LeaseExpiredError if the lease ran out (gc may have taken the pins)."""
        error = self._live_lease().error
        if error is not None:
            raise error

    def expect(self, chunks: Iterable[Chunk]) -> None:
        """Count progress (``"take"``, raw bytes) against these chunks: every chunk of the take,
        told before the first :meth:`store` (without a progress callback: nothing)."""
        self._meter = meter(self._progress, "take", sum(c.nbytes for c in chunks))

    def _tick(self, n: int) -> None:
        if self._meter is not None:
            self._meter.add(n)

    # --- chunks -----------------------------------------------------------------------------
    def hash(self, chunks: list[Chunk]) -> None:
        """Fill in every chunk's id (blake3 of its raw bytes) and check (the XXH3-64 every
        read verifies, ``objects.raw_check``), on the workers; the guard measures watched
        chunks in the same pass."""
        hash_chunk = self.guard.hash_chunk
        groups = hash_groups(chunks, self.opts.threads)
        done = self._workers().map(lambda group: [hash_chunk(c) for c in group], groups)
        for group, results in zip(groups, done):
            for chunk, (cid, check, stats) in zip(group, results):
                chunk.id, chunk.check = cid, check
                self.guard.record(chunk, stats)

    def pin(self, chunk_ids: Iterable[str]) -> set[str]:
        """Pin the chunks the store has among ``chunk_ids`` to this session; return those."""
        return set(self.index.lookup_chunks(self.session, list(chunk_ids)))

    def store(
        self,
        chunks: list[Chunk],
        *,
        hashed: bool = False,
        then: Callable[[], None] | None = None,
        defer: bool = False,
    ) -> None:
        """Hash ``chunks`` (unless ``hashed``), pin those the store has, write those it lacks.

        Each chunk id is handled once per take, whatever the number of calls. Works in batches
        of about ``HASH_BATCH_BYTES``: while one batch's missing chunks are encoded and written,
        the next is hashed and looked up. Chunks of device tensors are copied into bounded host
        pools batch by batch (``device_stage``). ``then`` runs once every chunk is hashed and
        queued, while the last packs are still being written (a take stores its manifest there).

        With ``defer``, the last pack written is durable when this returns but recorded in the
        index only by :meth:`commit`'s transaction (one transaction less: a small take writes
        one pack). Only for a take that commits in this process with nobody else waiting for
        its chunks: another rank's commit, or a hand-over, needs them indexed now.
        """
        started = time.perf_counter()
        stager = DeviceStager(self.opts.chunk_bytes)
        device = any(c.source is not None for c in chunks)
        max_bytes = min(HASH_BATCH_BYTES, stager.batch_bytes) if device else HASH_BATCH_BYTES
        max_count = min(HASH_BATCH_CHUNKS, stager.batch_chunks) if device else HASH_BATCH_CHUNKS
        try:
            with PackPipeline(
                self.repo.objects,
                self.index,
                self.session,
                self.opts,
                self._workers(),
                self._deferred if defer else None,
                on_added=self._tick,
                buffers=self._buffers,
            ) as pipe:
                for batch in batches(chunks, max_bytes, max_count, FIRST_BATCH_BYTES):
                    stager.stage(batch)
                    if not hashed:
                        self.hash(batch)
                    self._store_batch(batch, pipe)
                    if device:
                        pipe.drain()  # the batch's staged bytes are encoded: its buffers are free
                        stager.release()
                if then is not None:
                    then()
        finally:
            stager.close()
        self.stats.add(pipe.stats)
        self.check_lease()
        nbytes = sum(c.nbytes for c in chunks)
        if not self.opts.polite and nbytes >= RATE_MIN_BYTES:
            self.repo.persist_rate = nbytes / max(time.perf_counter() - started, 1e-9)

    def _store_batch(self, batch: list[Chunk], pipe: PackPipeline) -> None:
        new: dict[str, Chunk] = {}
        for c in batch:
            if c.id not in self._seen:
                new.setdefault(c.id, c)
        self._seen.update(new)
        found = self.pin(new)
        self.stats.reused_chunks += len(found)
        missing = [c for cid, c in new.items() if cid not in found]
        self.stats.written_raw_bytes += sum(c.nbytes for c in missing)
        self._tick(
            sum(c.nbytes for c in batch) - sum(c.nbytes for c in missing)
        )  # found, or seen before
        resolve_bases(self.index, self.session, missing, self.opts.delta_depth)
        for c in missing:
            pipe.push(c)

    # --- the commit -------------------------------------------------------------------------
    def manifest(self, apps: dict[str, Any], entries: dict[str, Entry], **header: Any) -> Manifest:
        """The manifest of this take: ``apps`` and ``entries`` under the spec's labels
        (``header`` adds distributed fields: ``world_size``, ``ranks``, ``dcp``), with the
        guard's findings as its ``health``.

        Raises:
            NonFiniteError, StaleStateError: the guard refused the state (``on_nonfinite`` /
                ``on_stale`` ``"raise"``); nothing is committed.
        """
        return Manifest(apps, entries, self.header(entries, **header))

    def header(
        self, entries: Mapping[str, Any], summed: Summed | None = None, **extra: Any
    ) -> dict[str, Any]:
        """The ``snapshot`` header of this take's manifest (see :meth:`manifest`; ``summed``:
        the figures the ranks of a take in parts found together, ``TakeGuard.assess``)."""
        health = self.guard.assess(entries, summed).to_dict()
        return self.spec.header(
            created_at=self.started,
            session=self.session,
            **extra,
            **({"health": health} if health else {}),
        )

    def put_manifest(self, manifest: Manifest, validate: bool = False) -> tuple[str, int]:
        """Store ``manifest`` (durable, visible to nobody yet); its id and size."""
        raw, manifest_id, wrote = put_manifest(self.repo.objects, manifest, validate)
        if not wrote:  # found in place: put back after the commit if a gc deleted it meanwhile
            self._found_manifests[manifest_id] = raw
        return manifest_id, len(raw)

    def commit(
        self,
        manifest: Manifest,
        *,
        stored: tuple[str, int] | None = None,
        validate: bool = False,
        figures: dict[str, int] | None = None,
    ) -> SnapshotRecord:
        """Store ``manifest`` (unless ``stored``: its id and size) and commit the snapshot in one
        index transaction, moving the spec's tags to it (I1).

        ``validate`` parses the manifest back before storing it (one assembled from several
        ranks' pieces must tile every tensor). ``figures`` (``new_bytes``, ``new_chunks``,
        ``reused_chunks``) replace this process's own (a take of several processes).

        Raises:
            LeaseExpiredError: the session's lease ran out; nothing was committed.
            ConflictError: the name is taken or a tag conflicts; nothing was committed.
        """
        self.check_lease()
        stored = stored or self.put_manifest(manifest, validate)
        record = commit_manifest(
            self.index,
            self.session,
            manifest,
            stored,
            self.spec.tag_specs,
            packs=self._deferred,
            **(figures or self.stats.figures()),
        )
        self._live_lease().committed = True
        found = self._found_manifests.pop(record.manifest_id, None)
        if found is not None:
            self.repo.objects.put_blob_back("manifests", found)
        if self._meter is not None:
            self._meter.finish()
        self.repo.committed(record)
        remember(record.manifest_id, manifest)  # the run's next take compares with it
        return record

    # --- a take in parts (docs/FORMAT.md, 7.7) -------------------------------------------------
    def staging(self) -> str:
        """The id of this take's staging session, begun on first call and ended with the take:
        the processes of a take in parts pin there every chunk their parts name
        (:meth:`pin_staged`), and :meth:`commit_root` makes its pins the snapshot's references."""
        if self._staging is None:
            self._live_lease()
            self._staging = Lease(self.repo.index, self.opts.lease_seconds).__enter__()
        return self._staging.id

    def pin_staged(self, staged: str, chunk_ids: Iterable[str], where: str) -> None:
        """Pin ``chunk_ids`` to the staging session ``staged`` (another process's, maybe).

        Raises:
            NotFoundError: a chunk is not in the index (``where`` names what named it).
            LeaseExpiredError: the staging session ended (its take failed or ran out).
        """
        ids = set(chunk_ids)
        missing = ids - set(self.index.lookup_chunks(staged, sorted(ids)))
        if missing:
            raise NotFoundError(
                f"{where} names chunk {min(missing)}, which is not in the index "
                f"({len(missing)} such chunks); nothing was committed"
            )

    def store_objects(self, raws: list[bytes], key: str, *, defer: bool = False) -> list[str]:
        """Store each of ``raws`` as a chunk (a manifest's part or node: content-addressed,
        packed, pinned to this session like the take's own chunks); their ids. The take's
        figures do not count them."""
        if not raws:
            return []
        before = replace(self.stats)
        chunks = [Chunk(key, memoryview(raw), 1, False) for raw in raws]
        self.store(chunks, defer=defer)
        self.stats = before
        return [c.id for c in chunks]

    def commit_root(
        self,
        raw: bytes,
        header: dict[str, Any],
        entries: list[EntryRecord],
        chunk_ids: Iterable[str],
        *,
        logical_bytes: int,
        figures: dict[str, int],
    ) -> SnapshotRecord:
        """Store the root of a manifest in parts (``raw``, with ``header``) and commit its
        snapshot in one index transaction: ``entries`` its index rows, ``chunk_ids`` the chunks
        this process names, the staging session's pins the rest (I1).

        Raises:
            LeaseExpiredError: this session or the staging session ran out; nothing committed.
            ConflictError: the name is taken or a tag conflicts; nothing was committed.
        """
        self.check_lease()
        staged = self.staging()
        manifest_id, wrote = self.repo.objects.store_blob("manifests", raw)
        record = snapshot_record(header, manifest_id, logical_bytes, **figures)
        committed = self.index.commit_snapshot(
            self.session,
            record,
            entries,
            chunk_ids,
            len(raw),
            self.spec.tag_specs,
            self._deferred,
            staged,
        )
        self._live_lease().committed = True
        assert self._staging is not None
        self._staging.committed = True
        if not wrote:  # found in place: a gc may have deleted it before the commit named it
            self.repo.objects.put_blob_back("manifests", raw)
        if self._meter is not None:
            self._meter.finish()
        self.repo.committed(committed)
        return committed

    def adopt(self, record: SnapshotRecord) -> None:
        """This take's commit happened though :meth:`commit_root` raised (the index's answer
        was lost, and the index said so since): its sessions ended with it; run the
        repository's hooks after a commit, as :meth:`commit_root` does."""
        self._live_lease().committed = True
        if self._staging is not None:
            self._staging.committed = True
        if self._meter is not None:
            self._meter.finish()
        self.repo.committed(record)

    def hand_over(self) -> None:
        """End the session as committed without committing here: the process that commits
        has pinned (or committed) everything this one stored."""
        lease = self._live_lease()
        for (
            pack,
            chunks,
        ) in self._deferred:  # deferred packs must be indexed before anyone commits them
            self.index.add_pack(lease.id, pack, chunks)
        self._deferred.clear()
        try:
            self.index.end_session(lease.id, "committed")
            lease.committed = True
        except Exception:  # noqa: BLE001 - the session expires by itself; the pins it dropped are held elsewhere
            pass

    # --- internals --------------------------------------------------------------------------
    def _live_lease(self) -> Lease:
        if self._lease is None:
            raise InvalidInputError(
                "LocalTake used outside its session: call open() or use it in a with block"
            )
        return self._lease

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise InvalidInputError(
                "LocalTake used outside its session: call open() or use it in a with block"
            )
        return self._pool


HASH_GROUP_BYTES = 1 << 20
"""The least a group of chunks hashed by one worker task holds (``hash_groups``)."""


def hash_groups(chunks: list[Chunk], threads: int) -> list[list[Chunk]]:
    """``chunks`` in order, cut into consecutive groups a worker hashes in one task: about four
    groups per thread, none under ``HASH_GROUP_BYTES`` unless it is the last.

    One task per chunk made a future, its condition, lock and queue per chunk, alive until
    the batch was hashed: a take of a thousand small tensors left thousands of objects for
    Python's collector to promote, and full collections followed every few takes (the
    training loop's thread pays them). A group keeps the workers as busy as single chunks
    did: its bytes are a quarter of a thread's share.
    """
    total = sum(c.nbytes for c in chunks)
    limit = max(total // (4 * max(1, threads)), HASH_GROUP_BYTES)
    groups: list[list[Chunk]] = []
    group: list[Chunk] = []
    size = 0
    for chunk in chunks:
        n = chunk.nbytes
        if group and size + n > limit:
            groups.append(group)
            group, size = [], 0
        group.append(chunk)
        size += n
    if group:
        groups.append(group)
    return groups
