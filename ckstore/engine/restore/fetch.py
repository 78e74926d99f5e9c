"""Chunk jobs of a restore: the passes that read, check and place each chunk's bytes.

Each payload is read once and checked once, on ``threads`` threads (zstd, numpy, XXH3, BLAKE3
and file reads release the GIL): decoded and hashed block by block as it goes (a chunk stored
raw with a destination of its own: read straight into it, hashed piece by piece), against its check
from the manifest, or its id (docs/RELIABILITY.md, I3). Two ways to run a list of jobs:

* :meth:`Fetcher.load` alone: read, check and decode into the destination at once (new
  tensors, ``restore(atomic=False)``, the distributed restore's reads for other ranks).
* :meth:`Fetcher.verify` then :meth:`Fetcher.load` (atomic restore): the first pass checks
  every chunk without touching any destination, the second puts them in place, fetching
  nothing from storage that the first pass fetched:

  - On a store that maps its packs (``Backend.mapped_views``: a local disk), the first pass
    keeps the views of the payloads it checked, and the second decodes them into place,
    hashed against the check again as they land (``objects.into_place``: a decoder that errs
    only this time), or reads a raw one again from the very pack (``Backend.read_view_into``):
    they are the very bytes checked, of an immutable pack (one written in place meanwhile is
    refused, ``Backend.current``). Their pages go back after each pass (``Backend.drop``).
  - A compressed chunk that fits a bounded :class:`~ckstore.engine.restore.staging.Arena`
    (the memory budget) is decoded and checked into it and copied into place: decoded once.
  - Elsewhere (S3, where the first pass also keeps a copy of what it read in a spill file:
    ``objects.StashingBackend``) a chunk is checked and a fingerprint of its payload kept;
    the second pass reads it again, compares the fingerprint and decodes it into place.
  - Verifying by id (``verify="full"``, or a chunk without a check), a chunk with payload
    digests is compared with them in the first pass, decoded and hashed in the second.

The first pass of a local store tells the kernel which byte ranges come next
(``Backend.prefetch``, about :data:`READ_AHEAD` bytes ahead), so a cold restore reads the disk
while the threads check what arrived, unless the kernel reads far enough ahead of the pass's
faults itself (``readahead.hinted``: hinted pages stay 4 KiB pages). A destination that is not
a contiguous CPU tensor (strided, or on a GPU) is reached through host buffers
(``staging.Pools``: pinned for CUDA, two per thread): a chunk is decoded into one and copied
by the device's :class:`~ckstore.engine.devices.Copier` while the next one is decoded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ... import objects
from ...errors import CorruptionError, ObjectNotFoundError
from ...format.dtypes import dtype_from_name
from ..devices import DONE
from ..locations import MAX_MOVES, places, to_location
from ..progress import ProgressFn, meter
from .jobs import Job, raw_bytes
from .readahead import ReadAhead, hinted
from .sources import ChunkSource, Healer
from .staging import Arena, Pools, arena_copier
from .workers import share

if TYPE_CHECKING:
    from ..interfaces import LocationIndex

INLINE_BYTES = 4 << 20
"""A pass over fewer raw bytes than this runs on the calling thread: starting worker threads
costs more (2 cores: a 1 MiB state restored in 17.5 ms on 2 threads, 10.7 ms on one)."""


_SKIP_CHECKS = [False]


@contextmanager
def unchecked() -> Iterator[None]:
    """Restores this process starts inside skip the check of each chunk's decoded bytes
    (keys, shapes, lengths and formats are still checked): what a benchmark measures the
    checks' share of a restore against. ckstore never enters it, and nothing else should."""
    was, _SKIP_CHECKS[0] = _SKIP_CHECKS[0], True
    try:
        yield
    finally:
        _SKIP_CHECKS[0] = was


@dataclass
class _Checked:
    """What the first pass learnt of one chunk, for the second (one of the four)."""

    staged: memoryview | None = None
    """Its decoded, checked bytes in the arena."""
    kept: objects.Kept | None = None
    """The mapped views of its chain's payloads, checked (or, ``by_id``, digests compared)."""
    fingerprint: int | None = None
    """The fingerprint of its payload, checked (read again and compared)."""
    by_id: bool = False
    """Its payloads were compared with their digests only: decode and hash against the id."""


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
        heal: Healer | None = None,
    ) -> None:
        self.objs, self.index, self.where, self.threads = objs, index, where, max(1, threads)
        self.progress = progress
        self.heal = heal
        """Heals a chunk found damaged or missing (:data:`Healer`); None: it raises."""
        self.full = verify == "full"
        """Verify every chunk against its id (BLAKE3), not against its check."""
        self._skip = _SKIP_CHECKS[0]
        self._executor: ThreadPoolExecutor | None = None
        self._stash: objects.StashingBackend | None = None
        self._checked: dict[str, _Checked] = {}

    def close(self) -> None:
        """Stop the worker threads (their read buffers go with them), let go of what the first
        pass kept (its mappings too) and drop the spill file."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._checked.clear()
        if self._stash is not None:
            self._stash.close()
            self._stash = None

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_once(self) -> None:
        """From now on, keep a copy of every payload read where reading it again would fetch it
        from storage again (``Backend.cached_locally`` False: S3): the second pass reads what
        the first read from the copy, so an atomic restore reads the store once."""
        if self._stash is None and not self.objs.backend.cached_locally:
            self._stash = objects.StashingBackend(self.objs.backend)
            self.objs = objects.ObjectStore(self._stash)

    # -- the passes ------------------------------------------------------------------------
    def verify(self, jobs: list[Job], budget: int | None) -> Arena:
        """Check every distinct chunk of ``jobs`` without touching any destination, and
        remember what the second pass (:meth:`load`) needs (see the module docstring).

        Compressed chunks are decoded into an arena of at most ``budget`` bytes (less the second
        pass's host pools; None: no limit) while it has room; returned (:meth:`apply` empties it).
        """
        self._locate(jobs)
        self._read_once()
        first = _distinct(jobs)
        mapped = self.objs.backend.mapped_views
        stage = [j for j in first if not (mapped and _raw(self._loc(j)))]
        want = sum(-(-self._loc(j).raw_length // 64) * 64 for j in stage)  # 64-byte aligned
        room = want if budget is None else max(0, budget - Pools.bytes_needed(self.threads, jobs))
        arena = Arena(room, want, arena_copier(jobs))
        staging = {j.cid for j in stage}

        def one(job: Job) -> None:
            loc, check = self._loc(job), self._check(job)
            c = _Checked(staged=arena.take(loc.raw_length) if job.cid in staging else None)
            if c.staged is None and check is None and loc.digests_known():
                c.by_id, c.kept = True, {} if mapped else None
                self._guard(
                    job,
                    lambda: self.objs.check_payloads(self._loc(job), keep=c.kept),
                    given=lambda data: healed(c, data),
                )
            else:
                c.kept = {} if mapped and c.staged is None else None
                c.fingerprint = self._guard(
                    job,
                    lambda: self.objs.verify_chunk(  # at the chunk's place when it runs
                        self._loc(job),
                        c.staged,
                        fingerprint_it=c.staged is None and c.kept is None,
                        check=check,
                        keep=c.kept,
                    ),
                    given=lambda data: healed(c, data),
                )
            if c.kept is not None:
                self.objs.drop(self._loc(job))
            self._checked[job.cid] = c

        def healed(c: _Checked, data: memoryview) -> None:  # verified bytes from a healer
            if c.staged is not None:
                _memcpy(c.staged, data)
            else:
                c.staged = data
            c.kept, c.fingerprint, c.by_id = None, None, False

        self._run(first, one, "verify", ahead=hinted(self.objs, mapped=True))
        return arena

    def load(self, jobs: list[Job], source: ChunkSource | None = None) -> None:
        """Put each job's chunk in place: from ``source`` (bytes verified by whoever put them
        there) when it holds the chunk, else from what :meth:`verify` left for it, else read,
        checked and decoded into place in one pass."""
        found = [] if source is None else [(j, source.get(j.cid)) for j in jobs]
        given = {id(j): data for j, data in found if data is not None}
        self._locate([j for j in jobs if id(j) not in given])
        rest = [j for j in jobs if id(j) not in given]
        with Pools(self.threads, [j for j in jobs if j.out is None]) as pools:

            def one(job: Job) -> None:
                c = self._checked.get(job.cid)
                data = given.get(id(job))
                if data is None and c is not None:
                    data = c.staged
                if data is not None:
                    _place(job, pools, data)
                elif c is None:
                    self._deliver(
                        job,
                        pools,
                        lambda out: self.objs.verify_chunk(
                            self._loc(job), out, check=self._check(job)
                        ),
                    )
                else:
                    self._second(job, pools, c)

            self._run(
                [j for j in jobs if id(j) in given] + sorted(rest, key=_place_key),
                one,
                "restore",
                ahead=not self._checked and hinted(self.objs, mapped=False),
            )

    def apply(self, jobs: list[Job]) -> None:
        """The second pass of an atomic restore (:meth:`load`); the arena is let go after."""
        self.load(jobs)
        for c in self._checked.values():  # every copy out of the arena has completed
            c.staged = None

    def _second(self, job: Job, pools: Pools, c: _Checked) -> None:
        """Put a chunk the first pass checked (and did not stage) in place, checked again as
        it is decoded there (against its check; by id after a digests-only first pass)."""
        loc, check = self._loc(job), objects.UNCHECKED if self._skip else job.check
        if c.kept is not None:
            fill = partial(self.objs.load_kept, loc, c.kept, verify_id=c.by_id, check=check)
            self._deliver(job, pools, fill)
            self.objs.drop(loc)
        elif c.by_id:
            self._deliver(
                job,
                pools,
                lambda out: self.objs.load_digested(self._loc(job), out),
                moved=self._verified_copy,
            )
        else:
            expected = c.fingerprint
            assert expected is not None
            self._deliver(
                job,
                pools,
                lambda out: self.objs.load_verified(self._loc(job), out, expected, check),
                moved=self._verified_copy,
            )

    # -- helpers -----------------------------------------------------------------------------
    def _deliver(
        self,
        job: Job,
        pools: Pools,
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
                given=lambda data: _memcpy(out, data),
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
                given=lambda data: _memcpy(view, data),
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
        given: Callable[[memoryview], Any],
    ) -> Any:
        """Run ``fn`` (which reads ``job.loc`` when it runs) for ``job``: a pack gone since the
        chunk was located is looked up again (:meth:`_moved`) and ``fn`` runs again at the
        chunk's new place, or ``moved`` runs instead when its payload is not the one read before
        (compaction re-encoded it, at any of up to :data:`MAX_MOVES` moves followed). A chunk
        still damaged or missing is healed when a :data:`Healer` can: ``given`` runs on the
        verified bytes it hands back, or the chunk is read again at its new place (``moved``
        when given, the first pass's checks no longer covering it); else damage raises naming
        the key (and, unless ``fn`` was ``writing`` into a destination, saying nothing was
        restored)."""

        def again(how: str | None) -> Any:
            return moved() if how == "re-encoded" and moved is not None else fn()

        def followed() -> Any:  # the chunk may move again while it is looked up
            how: str | None = None
            for _ in range(MAX_MOVES):
                try:
                    return fn() if how is None else again(how)
                except ObjectNotFoundError:
                    if (now := self._moved(job)) is None:
                        raise
                    how = "re-encoded" if "re-encoded" in (how, now) else now  # once, for good
            return again(how)

        try:
            try:
                return followed()
            except (CorruptionError, ObjectNotFoundError):
                if self.heal is None:
                    raise
                healed = self.heal(job.cid)
                if isinstance(healed, memoryview) and len(healed) == self._loc(job).raw_length:
                    return given(healed)
                if healed is not True or self._moved(job) is None:
                    raise
                return again("re-encoded")
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
            elsewhere = places(new) != places(old)
            same = [_payload_key(l) for l in new.chain()] == [_payload_key(l) for l in old.chain()]
        except CorruptionError:
            return None
        if not elsewhere:
            return None
        job.loc = new
        return "moved" if same else "re-encoded"

    def _verified_copy(self, job: Job, out: memoryview) -> None:
        """Decode ``job``'s chunk into scratch memory, verify it, and only then copy it into
        ``out``: for a chunk re-encoded since the first pass checked it."""
        n = self._loc(job).raw_length
        scratch = _moved_scratch(n)[:n].data
        self.objs.verify_chunk(self._loc(job), scratch, check=self._check(job))
        _memcpy(out, scratch)

    def _check(self, job: Job) -> str | None:
        """What ``job``'s decoded bytes are verified against: its check, or (None) its id."""
        if self._skip:
            return objects.UNCHECKED
        return None if self.full else job.check

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

    @staticmethod
    def _loc(job: Job) -> objects.ChunkLocation:
        assert job.loc is not None
        return job.loc

    def _run(
        self, jobs: list[Job], fn: Callable[[Job], None], what: str = "", ahead: bool = False
    ) -> None:
        """Run ``fn`` over ``jobs`` on this fetcher's threads (on the calling thread when they
        hold under :data:`INLINE_BYTES`). The same threads serve every pass, so each thread's
        read buffers are allocated once per restore, not once per pass. With a progress
        callback, the pass counts as ``what`` (the raw bytes of each job done). With ``ahead``,
        the payloads of the jobs about :data:`READ_AHEAD` bytes further on are prefetched as
        each one starts."""
        gauge = (
            meter(self.progress, what, sum(raw_bytes(j) for j in jobs)) if what and jobs else None
        )
        hints = ReadAhead(self.objs, jobs) if ahead and jobs else None
        inner = fn

        def each(job: Job, i: int) -> None:
            if hints is not None:
                hints.upto(i)
            inner(job)
            if gauge is not None:
                gauge.add(raw_bytes(job))

        if self.threads == 1 or len(jobs) <= 1 or sum(raw_bytes(j) for j in jobs) < INLINE_BYTES:
            for i, j in enumerate(jobs):
                each(j, i)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix="ckstore-read"
            )
        share(self._executor, min(self.threads, len(jobs)), jobs, each)


def _distinct(jobs: list[Job]) -> list[Job]:
    """One job per chunk id (the first), in the order of their payloads in storage."""
    first: dict[str, Job] = {}
    for j in jobs:
        first.setdefault(j.cid, j)
    return sorted(first.values(), key=_place_key)


def _place_key(job: Job) -> tuple[str, int]:
    """Jobs sort in the order of their payloads in storage (packs read front to back)."""
    return ("", 0) if job.loc is None else (job.loc.pack_id, job.loc.offset)


def _raw(loc: objects.ChunkLocation) -> bool:
    """Whether a chunk is stored as it is (no decoding: staging it would only copy it)."""
    return loc.base_id is None and loc.codec == objects.NONE


def _place(job: Job, pools: Pools, data: memoryview) -> None:
    """Copy decoded, verified bytes into ``job``'s destination."""
    if job.out is not None:
        _memcpy(job.out, data)
    else:
        assert job.dst is not None
        pools.copier(job.dst).copy(job.dst, _chunk_tensor(job, data)[job.src])


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


def _chunk_tensor(job: Job, data: Any) -> torch.Tensor:
    """The decoded chunk ``data`` (a uint8 tensor or a buffer) as a tensor of its dtype and shape."""
    t = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
    return t.view(dtype_from_name(job.dtype)).reshape(job.sizes)


def _memcpy(out: memoryview, src: memoryview) -> None:
    """Copy with the GIL released (numpy), so threads copy in parallel."""
    np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)
