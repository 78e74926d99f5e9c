"""Chunk jobs of a restore: where each verified chunk's bytes go, and the passes that move them.

One pass over the bytes per chunk: its payload is read into a recycled buffer, decoded straight
into its destination (or a staging slot) and hashed block by block as it is decoded, on
``threads`` threads (zstd, numpy, BLAKE3 and file reads release the GIL). Three ways to run a
list of jobs:

* :meth:`Fetcher.load`: verify and decode into the destination at once (new tensors, or
  ``restore(atomic=False)``).
* :meth:`Fetcher.verify` then :meth:`Fetcher.apply` (atomic restore): the first pass checks
  every chunk without touching the destination, the second puts them in place.

  - Chunks that fit a bounded :class:`Arena` are decoded and verified into it by the first
    pass and copied into place by the second: read and decoded once.
  - Past the arena, a chunk whose payloads (its own and its bases') have digests in the index
    (every chunk written since index revision 0003) is checked by reading its payloads and
    comparing their digests, without decoding them. The second pass reads them again, compares
    the digests again and, only if they match, decodes straight into place, hashing as it
    goes: the BLAKE3 id still checks every decoded byte, and each chunk is decoded once.
  - Past the arena, a chunk without digests is decoded and verified by the first pass, which
    keeps a fingerprint of its payload; the second reads it again, checks the payload against
    the fingerprint (stored objects are immutable, so it decodes to the bytes just verified)
    and decodes it straight into place.

A destination that is not a contiguous CPU tensor (strided, or on a GPU) is reached through a
:class:`~ckstore.engine.devices.HostPool` of host buffers (pinned for CUDA): the chunk is decoded
into a buffer and copied by the device's :class:`~ckstore.engine.devices.Copier`, so the copy
to the device overlaps the reading and decoding of the next chunks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ... import objects
from ...errors import CorruptionError, ObjectNotFoundError
from ...format.dtypes import dtype_from_name
from .. import devices
from ..devices import DONE, Copier, HostPool
from ..interfaces import LocationIndex
from ..locations import to_location
from ..progress import ProgressFn, meter
from .jobs import Job

INLINE_BYTES = 4 << 20
"""A pass over fewer raw bytes than this runs on the calling thread: starting the worker threads
(and their read buffers) would cost more than it saves. Measured on 2 cores: a 1 MiB state
restored in 17.5 ms on 2 threads and 10.7 ms on one; at 8 MiB 2 threads win."""

POOL_BUFFERS_PER_THREAD = 2
"""Host buffers per thread for non-direct destinations: one being decoded into while the
previous one's copy to the device is still in flight."""


class ChunkSource(Protocol):
    """Chunks whose decoded bytes are already in memory and verified, by id (what a
    distributed restore received from the rank that read and verified them)."""

    def get(self, cid: str) -> memoryview | None:
        """The chunk's ``raw_length`` decoded bytes, or None when this source lacks it."""
        ...


class Arena:
    """Staging memory for verified chunks: slots handed out first come, up to ``capacity`` bytes.

    Allocated once, on first use, no larger than what it is asked for in total; pinned when a
    copy from it goes to a CUDA device.
    """

    def __init__(self, capacity: int, want: int, copier: Copier | None = None) -> None:
        self.capacity = max(0, min(capacity, want))
        self._copier = copier or Copier()
        self._buf: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview | None:
        """A slot of ``n`` bytes (64-byte aligned), or None once the arena is full."""
        with self._lock:
            start = -(-self._used // 64) * 64
            if start + n > self.capacity:
                return None
            if self._buf is None:
                self._buf = self._copier.host_buffer(self.capacity)
            self._used = start + n
            return memoryview(self._buf.numpy()).cast("B")[start : start + n]  # type: ignore[arg-type]

    @property
    def used(self) -> int:
        return self._used


class Fetcher:
    """Runs chunk jobs of one snapshot on ``threads`` threads (see the module docstring)."""

    def __init__(
        self,
        objs: objects.ObjectStore,
        index: LocationIndex,
        where: str,
        threads: int,
        progress: ProgressFn | None = None,
        verify: str = "fast",
    ) -> None:
        self.objs, self.index, self.where, self.threads = objs, index, where, max(1, threads)
        self.progress = progress
        self.full = verify == "full"
        """Verify every chunk against its id (BLAKE3), not against its check."""
        self._executor: ThreadPoolExecutor | None = None
        self._stash: objects.StashingBackend | None = None

    def close(self) -> None:
        """Stop the worker threads (their read buffers go with them) and drop the spill file."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stash is not None:
            self._stash.close()
            self._stash = None

    def _read_once(self) -> None:
        """From now on, keep a copy of every payload read where reading it again would fetch it
        from storage again (``Backend.cached_locally`` False: S3): :meth:`apply` reads what
        :meth:`verify` read from the copy, so an atomic restore reads the store once."""
        if self._stash is None and not self.objs.backend.cached_locally:
            self._stash = objects.StashingBackend(self.objs.backend)
            self.objs = objects.ObjectStore(self._stash)

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the three passes --------------------------------------------------------------------
    def load(self, jobs: list[Job], source: ChunkSource | None = None) -> None:
        """Verify each chunk and decode it into its destination, in one pass.

        Jobs whose chunk ``source`` holds are filled from it (bytes verified by whoever put
        them there) instead of from storage."""
        if source is not None:
            found = [(j, source.get(j.cid)) for j in jobs]
            jobs = [j for j, data in found if data is None]
            for j, data in found:
                j.staged = data
            self.apply([j for j, data in found if data is not None])  # copies them into place
        self._locate(jobs)
        with _Pools(self.threads, jobs) as pools:
            self._run(
                jobs,
                lambda j: self._deliver(
                    j,
                    pools,
                    lambda out: self.objs.verify_chunk(self._loc(j), out, check=self._check(j)),
                ),
                "restore",
            )

    def verify(self, jobs: list[Job], budget: int | None) -> Arena:
        """Check every chunk without touching any destination.

        While an arena of at most ``budget`` bytes (less what the host pools of the second
        pass need; None: no limit) has room, chunks are decoded and verified into it (read
        once, copied into place by ``apply``). Past it, a chunk's payloads are checked against
        their recorded digests, undecoded; a chunk without digests is decoded and verified,
        and its payload's fingerprint kept. Returns the arena (``apply`` empties it).
        """
        self._locate(jobs)
        self._read_once()
        want = sum(
            -(-self._loc(j).raw_length // 64) * 64 for j in jobs
        )  # slots are 64-byte aligned
        room = want if budget is None else max(0, budget - _Pools.bytes_needed(self.threads, jobs))
        arena = Arena(room, want, _arena_copier(jobs))

        def one(job: Job) -> None:
            loc = self._loc(job)
            job.staged = arena.take(loc.raw_length)
            job.checked = job.staged is None and loc.digests_known() and self._check(job) is None
            if job.checked:
                self._guard(job, lambda: self.objs.check_payloads(self._loc(job)))
                return
            keep = job.staged is None  # read again in the second pass: remember the payload
            job.fingerprint = self._guard(
                job,
                lambda: self.objs.verify_chunk(
                    self._loc(job), job.staged, fingerprint_it=keep, check=self._check(job)
                ),
            )

        self._run(jobs, one, "verify")
        return arena

    def apply(self, jobs: list[Job]) -> None:
        """Put what :meth:`verify` checked into the destinations: staged bytes are copied,
        the others read again (payloads checked against their digests, or against the
        fingerprint taken by :meth:`verify`) and decoded in place."""
        with _Pools(self.threads, [j for j in jobs if j.staged is None or j.out is None]) as pools:

            def one(job: Job) -> None:
                staged, expected = job.staged, job.fingerprint
                if staged is not None and job.out is not None:
                    _memcpy(job.out, staged)
                elif staged is not None:
                    assert job.dst is not None
                    pools.copier(job.dst).copy(job.dst, _chunk_tensor(job, staged)[job.src])
                elif job.checked:
                    self._deliver(
                        job,
                        pools,
                        lambda out: self.objs.verify_chunk(
                            self._loc(job), out, check_digests=True, check=self._check(job)
                        ),
                        moved=self._verified_copy,
                    )
                else:
                    assert expected is not None
                    self._deliver(
                        job,
                        pools,
                        lambda out: self.objs.load_verified(self._loc(job), out, expected),
                        moved=self._verified_copy,
                    )

            self._run(jobs, one, "restore")
        for job in jobs:  # every copy out of the arena has completed (the pools waited)
            job.staged = None

    # -- helpers -----------------------------------------------------------------------------
    def _deliver(
        self,
        job: Job,
        pools: _Pools,
        fill: Callable[[memoryview], Any],
        moved: Callable[[Job, memoryview], Any] | None = None,
    ) -> None:
        """Decode into ``job.out``, or into a pooled host buffer copied to ``job.dst``.

        ``moved`` replaces ``fill`` for a chunk found rewritten elsewhere since the first pass
        (its payload differs: the first pass's checks do not cover it)."""
        if job.out is not None or job.dst is None:
            out = job.out
            assert out is not None
            self._guard(
                job,
                lambda: fill(out),
                writing=True,
                moved=None if moved is None else lambda: moved(job, out),
            )
            return
        pool = pools.pool(job.dst)
        buf = pool.acquire()
        transfer = DONE
        try:
            n = self._loc(job).raw_length
            view = memoryview(buf.numpy()).cast("B")[:n]  # type: ignore[arg-type]
            self._guard(
                job,
                lambda: fill(view),
                writing=True,
                moved=None if moved is None else lambda: moved(job, view),
            )
            transfer = pool.copier.copy(job.dst, _chunk_tensor(job, buf[:n])[job.src])
        finally:
            pool.release(buf, transfer)

    def _guard(
        self,
        job: Job,
        fn: Callable[[], Any],
        *,
        writing: bool = False,
        moved: Callable[[], Any] | None = None,
    ) -> Any:
        """Run ``fn`` (which reads ``job.loc`` when it runs) for ``job``: a pack gone since the
        chunk was located is looked up again (:meth:`_moved`) and ``fn`` runs again at the
        chunk's new place, or ``moved`` runs instead when its payload is not the one read before
        (compaction re-encoded it). Damage raises naming the key (and, unless ``fn`` was
        ``writing`` into a destination, saying nothing was restored)."""
        try:
            try:
                return fn()
            except ObjectNotFoundError:
                how = self._moved(job)
                if how is None:
                    raise
                return moved() if how == "re-encoded" and moved is not None else fn()
        except CorruptionError as exc:
            done = "" if writing else " nothing was restored."
            raise CorruptionError(
                f"{self.where}: key {job.key!r} is damaged in storage ({exc});{done} Run "
                "`ckstore check --read-data` and restore an older snapshot"
            ) from exc

    def _moved(self, job: Job) -> str | None:
        """Look ``job``'s chunk up again after a read found a pack of its chain gone: gc may have
        moved the chunk to a new pack, or compaction re-encoded it there, and deleted the old
        pack once its grace period passed (docs/RELIABILITY.md, I4). Returns None if it did not
        move, else ``job.loc`` is updated and the answer says whether the payloads are the same
        bytes (``"moved"``: gc copied them, so the checks made so far still hold) or not
        (``"re-encoded"``)."""
        locs = self.index.chunk_locations([job.cid])
        rec = locs.get(job.cid)
        if rec is None:
            return None
        new = to_location(rec, locs)
        old = self._loc(job)
        try:
            places = [(l.pack_id, l.offset) for l in new.chain()] != [
                (l.pack_id, l.offset) for l in old.chain()
            ]
            same = [_payload_key(l) for l in new.chain()] == [_payload_key(l) for l in old.chain()]
        except CorruptionError:
            return None
        if not places:
            return None
        job.loc = new
        return "moved" if same else "re-encoded"

    def _verified_copy(self, job: Job, out: memoryview) -> None:
        """Decode ``job``'s chunk into scratch memory, verify it against its id, and only then
        copy it into ``out``: for a chunk re-encoded since the first pass checked it."""
        n = self._loc(job).raw_length
        scratch = _moved_scratch(n)[:n].data
        self.objs.verify_chunk(self._loc(job), scratch, check=self._check(job))
        _memcpy(out, scratch)

    def _locate(self, jobs: list[Job]) -> None:
        missing = {j.cid for j in jobs if j.loc is None}
        locs = self.index.chunk_locations(missing) if missing else {}
        for j in jobs:
            if j.loc is None:
                rec = locs.get(j.cid)
                if rec is None:
                    raise CorruptionError(
                        f"{self.where}: key {j.key!r} needs chunk {j.cid[:16]}… which the index does not "
                        "know; run `ckstore check` (the index may need `ckstore reindex`)"
                    )
                j.loc = to_location(rec, locs)

    def _check(self, job: Job) -> str | None:
        """What ``job``'s decoded bytes are verified against: its check, or (None) its id."""
        return None if self.full else job.check

    @staticmethod
    def _loc(job: Job) -> objects.ChunkLocation:
        assert job.loc is not None
        return job.loc

    def _run(self, jobs: list[Job], fn: Callable[[Job], None], what: str = "") -> None:
        """Run ``fn`` over ``jobs`` on this fetcher's threads (on the calling thread when they
        hold under :data:`INLINE_BYTES`). The same threads serve every pass, so each thread's
        read buffers are allocated once per restore, not once per pass. With a progress
        callback, the pass counts as ``what`` (the raw bytes of each job done)."""
        gauge = meter(self.progress, what, sum(_raw(j) for j in jobs)) if what and jobs else None
        if gauge is not None:
            inner = fn

            def fn(job: Job) -> None:
                inner(job)
                gauge.add(_raw(job))

        if self.threads == 1 or len(jobs) <= 1 or sum(_raw(j) for j in jobs) < INLINE_BYTES:
            for j in jobs:
                fn(j)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix="ckstore-read"
            )
        for _ in self._executor.map(fn, jobs):
            pass


class _Pools:
    """One host pool per destination device of the jobs that need one; waits for every copy on exit."""

    def __init__(self, threads: int, jobs: list[Job]) -> None:
        self._threads = threads
        self._size = max((_raw(j) for j in jobs if j.out is None and j.dst is not None), default=0)
        self._pools: dict[torch.device, HostPool] = {}
        self._lock = threading.Lock()

    @staticmethod
    def bytes_needed(threads: int, jobs: list[Job]) -> int:
        """Host memory the pools may take for these jobs (per destination device)."""
        sizes = [_raw(j) for j in jobs if j.out is None and j.dst is not None]
        devices = {j.dst.device for j in jobs if j.out is None and j.dst is not None}
        return max(sizes, default=0) * POOL_BUFFERS_PER_THREAD * threads * len(devices)

    def pool(self, dst: torch.Tensor) -> HostPool:
        with self._lock:
            pool = self._pools.get(dst.device)
            if pool is None:
                pool = self._pools[dst.device] = HostPool(
                    devices.copier_for(dst), self._size, POOL_BUFFERS_PER_THREAD * self._threads
                )
            return pool

    def copier(self, dst: torch.Tensor) -> Copier:
        return self.pool(dst).copier

    def __enter__(self) -> _Pools:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self._pools.values():
            pool.drain()
            pool.copier.finish()


def _payload_key(loc: objects.ChunkLocation) -> tuple[str, int, str | None]:
    """What identifies a stored payload's bytes, wherever it lives."""
    return (loc.codec, loc.length, loc.payload_digest)


_moved_local = threading.local()


def _moved_scratch(n: int) -> np.ndarray:
    """This thread's scratch buffer for re-encoded chunks (rare: grown on demand)."""
    buf: np.ndarray | None = getattr(_moved_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _moved_local.buf = np.empty(n, dtype=np.uint8)
    return buf


def _raw(job: Job) -> int:
    if job.staged is not None:
        return len(job.staged)
    return (
        job.loc.raw_length
        if job.loc is not None
        else math.prod(job.sizes) * dtype_from_name(job.dtype).itemsize
    )


def _arena_copier(jobs: list[Job]) -> Copier:
    """Pinned arena memory when a staged chunk will be copied to a CUDA device."""
    for j in jobs:
        if j.dst is not None and j.dst.device.type == "cuda":
            return devices.copier_for(j.dst)
    return Copier()


def _chunk_tensor(job: Job, data: Any) -> torch.Tensor:
    """The decoded chunk ``data`` (a uint8 tensor or a buffer) as a tensor of its dtype and shape."""
    t = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
    return t.view(dtype_from_name(job.dtype)).reshape(job.sizes)


def _memcpy(out: memoryview, src: memoryview) -> None:
    """Copy with the GIL released (numpy), so threads copy in parallel."""
    np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)
