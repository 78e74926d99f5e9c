"""Packing: encode missing chunks in parallel and write them into packs, several at once.

The write half of a take (:class:`~ckstore.engine.take.local.LocalTake` decides what is
missing and feeds the pipeline). Packs are made durable before they are indexed (I1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import objects
from ...errors import CorruptionError, ObjectNotFoundError
from ...index import ChunkRecord, PackRecord
from ..background import polite_pool
from ..locations import to_records

if TYPE_CHECKING:
    from ..interfaces import WriteIndex
    from ..repository import Repository


WORKING_EXTRA = 16 << 20
"""What a take's memory reaches beyond its buffers (see ``TakeOptions.working_bytes``)."""


@dataclass(frozen=True)
class TakeOptions:
    """Knobs of one take (defaults come from the store's config)."""

    chunk_bytes: int
    pack_bytes: int
    inline_bytes: int
    threads: int
    lease_seconds: float
    io_threads: int = 4
    """Packs written (and fsynced) at once."""
    delta_depth: int = 0
    """Longest delta chain a take may build (0: every chunk is stored whole)."""
    fast: bool = True
    """Encode whole chunks with the fast codec (``exp-zstd`` for floats, raw otherwise), as a
    take does; compaction encodes densely (``fast=False``)."""
    raw: bool = False
    """Store whole chunks as they are (codec ``none``, no encoding work), in loose packs."""
    polite: bool = False
    """Run the workers at the lowest CPU priority: work that finishes behind training
    (``engine/background.py``)."""
    direct: bool = False
    """Write packs around the page cache where the backend can (``objects/direct.py``; the
    knob ``direct_writes``)."""

    def working_bytes(self) -> int:
        """Memory a take's own work reaches besides the chunks' bytes, on a store whose packs
        stream to disk: one encode buffer per chunk in flight (:class:`PackPipeline`'s window
        and the one being filled), a chunk of scratch per worker (a codec's planes and
        frames), and ``WORKING_EXTRA`` for the rest (index, thread stacks, compressor
        contexts, allocator slack; measured with the bench's RSS sampler)."""
        window = (max(2, 2 * self.threads) + 1) * objects.grouped_size(self.chunk_bytes, 16)
        return window + self.threads * self.chunk_bytes + WORKING_EXTRA

    @classmethod
    def of(cls, repo: Repository, deltas: bool = False) -> TakeOptions:
        """The options a take into ``repo`` runs with (``deltas``: it has a base)."""
        return cls(
            chunk_bytes=repo.config.chunk_bytes,
            pack_bytes=repo.config.pack_bytes,
            inline_bytes=repo.config.inline_bytes,
            threads=repo.threads,
            lease_seconds=repo.lease_seconds,
            io_threads=repo.io_threads,
            delta_depth=repo.delta_depth if deltas else 0,
            fast=repo.take_codec != "dense",
            raw=repo.take_codec == "raw",
            direct=repo.direct_writes == "always",
        )


@dataclass
class Chunk:
    """One grid chunk of a tensor: a zero-copy view of its raw bytes, and its id once hashed.

    A chunk of a device tensor (``source``: its flat uint8 bytes on the device) has no host
    bytes until a take stages it (``engine/take/device_staging.py``): ``view`` is then a host buffer
    of a bounded pool, valid once ``transfer`` completed.
    """

    key: str
    view: memoryview
    itemsize: int
    grouped: bool
    id: str = ""
    check: str = ""
    """The chunk's check (``objects.raw_check``), set with its id."""
    source: Any = None
    transfer: Any = None
    base_id: str = ""
    """The chunk at the same place in the take's delta base snapshot (a candidate)."""
    base: objects.ChunkLocation | None = None
    """The base chosen and pinned (``engine/take/deltas.py``), with its chain; None: store it whole."""
    depth: int = 0
    """The chain depth it gets when stored as a delta against ``base``."""

    @property
    def nbytes(self) -> int:
        """The chunk's raw size in bytes."""
        return int(self.source.numel()) if self.source is not None else len(self.view)

    def ready(self) -> memoryview:
        """The host bytes, once any copy from the device into them completed."""
        if self.transfer is not None:
            self.transfer.wait()
        return self.view


@dataclass
class WriteStats:
    new_bytes: int = 0
    new_chunks: int = 0
    delta_chunks: int = 0
    """Chunks stored as deltas..."""
    delta_raw_bytes: int = 0
    """...their raw size..."""
    delta_bytes: int = 0
    """...and what they took."""


class PackPipeline:
    """Encode chunks in parallel, fill packs in chunk order, write several packs at once.

    At most ``2 * opts.threads`` encodes are in flight and at most ``opts.io_threads`` packs
    are being written, each made durable by ``_finish`` and then indexed (``add_pack``); with
    ``deferred``, the last pack is left in that list for the commit's own transaction to record
    (the others are indexed as they are written, so what a killed take wrote stays pinned to
    its session and named by ``ckstore du``, not an orphan). Where the
    backend streams a pack to a staging file as it fills (local disks), each encode buffer is
    free again as soon as its payload is added, so memory stays bounded by the encode window
    (``2 * threads`` chunks); elsewhere by about ``(io_threads + 1) * pack_bytes``, whatever the
    state's size. Writing packs concurrently keeps the device busy while each waits for its
    fsync: one pack at a time left it idle between fsyncs and was the first take's bottleneck.
    Use as a context manager: leaving it (even on error) waits for every write in flight.
    """

    def __init__(
        self,
        store: objects.ObjectStore,
        index: WriteIndex,
        session: str,
        opts: TakeOptions,
        pool: ThreadPoolExecutor,
        deferred: list[tuple[PackRecord, list[ChunkRecord]]] | None = None,
        on_added: Callable[[int], None] | None = None,
        buffers: deque[np.ndarray] | None = None,
    ) -> None:
        self._store, self._index, self._session, self._opts, self._pool = (
            store,
            index,
            session,
            opts,
            pool,
        )
        self._deferred = deferred
        self._on_added = on_added  # told the raw bytes of each chunk once it is in a pack
        self._window = max(2, 2 * opts.threads)
        self._io = (
            polite_pool(opts.io_threads, "ckstore-pack")
            if opts.polite
            else ThreadPoolExecutor(
                max_workers=max(1, opts.io_threads), thread_name_prefix="ckstore-pack"
            )
        )
        self._encoding: deque[tuple[Chunk, np.ndarray | None, Future[tuple[str, Any]]]] = deque()
        self._depths: dict[str, int] = {}  # chain depth of each delta written
        self._delta_tries: dict[
            str, list[int]
        ] = {}  # leaf name -> [deltas kept, deltas not paying]
        self._flushing: deque[Future[None]] = deque()
        self._writer = store.new_pack_writer(opts.pack_bytes, direct=opts.direct)
        self._submitted = False  # whether self._writer is handed to the io threads
        self._held: list[np.ndarray] = []  # buffers the current pack's payloads live in
        # buffers whose pack is written, reused (``buffers``: a pool several pipelines of one
        # take share, so the take holds one window of them however many calls store chunks)
        self._free: deque[np.ndarray] = deque() if buffers is None else buffers
        self.stats = WriteStats()

    def __enter__(self) -> PackPipeline:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                while self._encoding:
                    self._add_next()
                self._submit_flush(last=True)
                while self._flushing:
                    self._flushing.popleft().result()
        finally:
            for _, _, fut in self._encoding:
                fut.cancel()
            self._io.shutdown(wait=True)
            if not self._submitted:
                self._writer.abort()  # a pack being filled when the take failed: nothing stays staged

    def push(self, chunk: Chunk) -> None:
        """Queue one chunk (its id known, absent from the store) for encoding and packing."""
        if chunk.base is not None and self._hopeless(chunk.key):
            chunk.base = (
                None  # deltas of its kind did not pay in this take: spare the double encode
            )
        encodes = chunk.grouped and (chunk.base is not None or not self._opts.raw)
        buf = (
            self._buffer(objects.grouped_size(len(chunk.view), chunk.itemsize)) if encodes else None
        )
        if chunk.base is not None:
            fut = self._pool.submit(_encode_delta, self._store, chunk, buf)
        elif self._opts.raw:
            fut = Future()
            fut.set_result((objects.NONE, chunk.ready()))
        else:
            fut = self._pool.submit(
                objects.encode, chunk.view, chunk.itemsize, chunk.grouped, 1, buf, self._opts.fast
            )
        self._encoding.append((chunk, buf, fut))
        while len(self._encoding) > self._window:
            self._add_next()

    def _hopeless(self, key: str) -> bool:
        """Whether deltas of tensors named like ``key`` (its last path component, e.g.
        ``exp_avg``) failed at least ``HOPELESS_AFTER`` times in this take and never paid: an
        optimizer's first moment changes too much between saves for a delta to pay, and each
        failed try costs a second compression."""
        kept, failed = self._delta_tries.get(_leaf(key), (0, 0))
        return kept == 0 and failed >= HOPELESS_AFTER

    def drain(self) -> None:
        """Wait until every chunk pushed so far is encoded and in a pack (its source bytes,
        such as a staging buffer, are no longer needed; packs may still be being written)."""
        while self._encoding:
            self._add_next()

    def _buffer(self, size: int) -> np.ndarray:
        """A recycled buffer (page faults of fresh 4 MiB allocations halved encode speed).

        A new one is left unfilled (``np.empty``): its pages are first touched by the encoding
        thread, not zeroed here on the thread that feeds the pipeline.
        """
        while self._free:
            buf = self._free.pop()
            if len(buf) >= size:
                return buf
        return np.empty(max(size, objects.grouped_size(self._opts.chunk_bytes, 16)), dtype=np.uint8)

    def _add_next(self) -> None:
        chunk, buf, fut = self._encoding.popleft()
        codec, payload = fut.result()
        if chunk.source is not None and codec == objects.NONE and self._writer.holds_payloads:
            payload = bytes(payload)  # a raw payload would point into a recycled staging buffer
        delta = objects.is_delta(codec)
        base_id = chunk.base.chunk_id if delta and chunk.base is not None else None
        if chunk.base is not None:
            self._delta_tries.setdefault(_leaf(chunk.key), [0, 0])[0 if delta else 1] += 1
        self._writer.add(chunk.id, codec, payload, len(chunk.view), base_id)
        if self._opts.delta_depth > 0:  # the next delta take reads it as a base without re-hashing
            self._store.trust(chunk.id, payload)
        if (
            buf is not None
        ):  # a payload in it stays referenced until its pack is written, unless written away
            held = codec in _IN_BUFFER and self._writer.holds_payloads
            (self._held if held else self._free).append(buf)
        self.stats.new_bytes += len(payload)
        self.stats.new_chunks += 1
        if self._on_added is not None:
            self._on_added(chunk.nbytes)
        if delta:
            self._depths[chunk.id] = chunk.depth
            self.stats.delta_chunks += 1
            self.stats.delta_raw_bytes += len(chunk.view)
            self.stats.delta_bytes += len(payload)
        if self._writer.full:
            self._submit_flush()
            self._writer, self._submitted = (
                self._store.new_pack_writer(self._opts.pack_bytes, direct=self._opts.direct),
                False,
            )

    def _submit_flush(self, last: bool = False) -> None:
        while len(self._flushing) >= max(1, self._opts.io_threads):
            self._flushing.popleft().result()
        held, self._held = self._held, []
        defer = last and self._deferred is not None

        def flush(writer: objects.PackWriter = self._writer) -> None:
            done = _finish(writer, self._depths, self._opts.fast)
            if done is not None and defer:
                assert self._deferred is not None
                self._deferred.append(done)  # recorded by the commit's own transaction
            elif done is not None:
                self._index.add_pack(self._session, *done)
            self._free.extend(held)  # the pack is durable: its payload buffers are free

        self._flushing.append(self._io.submit(flush))
        self._submitted = True


HOPELESS_AFTER = 3
"""Failed delta tries (and no success) after which a take stops trying deltas for tensors of
the same leaf name."""


def _leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1]


_IN_BUFFER = (objects.BYTEGROUP_ZSTD, objects.XOR_BYTEGROUP_ZSTD, objects.EXP_ZSTD)
"""Codecs whose payload may be a view into the recycled encode buffer."""


def _encode_delta(
    store: objects.ObjectStore, chunk: Chunk, buf: np.ndarray | None
) -> tuple[str, Any]:
    """Encode ``chunk`` against its base, or whole when the delta does not pay
    (``objects.encode_delta``).

    The base must be right, or the delta would be wrong forever: a base whose payloads this
    process wrote or verified itself (the previous take of a training loop) is decoded plane by
    plane and XORed without interleaving (``ObjectStore.trusted_planes``); any other is read
    and verified against its id through its chain (and trusted from then on).
    """
    assert chunk.base is not None
    n = len(chunk.view)
    base = None
    try:  # the trusted path too: its pack may be gone (a gc beside) or its chain broken
        root = chunk.base.chain()[-1]
        planes = store.trusted_planes(chunk.base, chunk.itemsize) if chunk.grouped else None
        if planes is None:
            base = memoryview(_scratch("base", n).data)[:n]
            store.read_chunk(chunk.base, out=base, trust=True)
    except (CorruptionError, ObjectNotFoundError) as exc:  # a damaged base never blocks a take
        log.warning(
            "key %r: its delta base %s is unreadable (%s); storing the chunk whole. "
            "Run `ckstore check --read-data`",
            chunk.key,
            chunk.base.chunk_id,
            exc,
        )
        return objects.encode(chunk.ready(), chunk.itemsize, chunk.grouped, 1, buf)
    if planes is not None:
        return objects.encode_delta(
            chunk.ready(),
            None,
            chunk.itemsize,
            chunk.grouped,
            buffer=buf,
            plain_estimate=root.length,
            base_planes=planes,
        )
    return objects.encode_delta(
        chunk.ready(),
        base,
        chunk.itemsize,
        chunk.grouped,
        scratch=_scratch("xor", n),
        buffer=buf,
        plain_estimate=root.length,
    )


_local = threading.local()
log = logging.getLogger(__name__)


def _scratch(kind: str, n: int) -> np.ndarray:
    """This thread's recycled buffer ``kind`` of at least ``n`` bytes."""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf: np.ndarray | None = bufs.get(kind)
    if buf is None or len(buf) < n:
        buf = bufs[kind] = np.empty(n, dtype=np.uint8)
    return buf


def _finish(
    writer: objects.PackWriter, depths: dict[str, int] | None = None, loose: bool = False
) -> tuple[PackRecord, list[ChunkRecord]] | None:
    """Make the pack durable; its index rows (None if it holds nothing)."""
    done = writer.finish()
    if done is None:
        return None
    pack_id, size, locs = done
    chunks = to_records(locs, depths)
    return PackRecord(pack_id, size, len(chunks), time.time(), loose=loose), chunks


def batches(
    chunks: list[Chunk], max_bytes: int, max_count: int, first_bytes: int | None = None
) -> Iterator[list[Chunk]]:
    """Consecutive runs of ``chunks`` of at most ``max_bytes`` (or ``max_count`` chunks).

    With ``first_bytes``, the first run holds at most that many bytes and each next one twice
    the last, up to ``max_bytes``: the writes start after a small first batch is hashed
    instead of after a full one (on a small state, a full first batch is all of it).
    """
    batch: list[Chunk] = []
    size = 0
    limit = max_bytes if first_bytes is None else min(first_bytes, max_bytes)
    for c in chunks:
        if batch and (size + c.nbytes > limit or len(batch) >= max_count):
            yield batch
            batch, size = [], 0
            limit = min(max_bytes, 2 * limit)
        batch.append(c)
        size += c.nbytes
    if batch:
        yield batch
