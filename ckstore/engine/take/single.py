"""The single-process take: state dicts to one committed snapshot, now or in the background.

Phases, one function each: state dicts -> plan (``plan.py``) -> delta bases ->
:class:`~ckstore.engine.take.local.LocalTake` (hash, pin what the store has, write what it
lacks, store the manifest, commit in one index transaction). Nothing is visible until that
commit (I1).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from ...format.manifest import Manifest
from ...format.tensors import check_tensor
from ...format.tree import Flat, flatten, is_array
from ...index import SnapshotRecord
from ..background import lower_priority
from ..progress import ProgressFn
from ..repository import Repository
from . import filling, offload
from .blocking import BlockingReport
from .deltas import base_manifest
from .guard import remember
from .local import LocalTake
from .packing import TakeOptions
from .plan import Plan, dtypes_of, finish_entries, plan, plan_flats, with_base
from .spec import TakeSpec
from .staging import StagingArena, arena_bytes, arena_for, fill, give_back


@dataclass
class TakeResult:
    """What a take wrote (the index records the same figures)."""

    record: SnapshotRecord
    manifest: Manifest


def take(
    repo: Repository, states: Mapping[str, Any], spec: TakeSpec, progress: ProgressFn | None = None
) -> TakeResult:
    """Store ``states`` (already-called state dicts) as one committed snapshot.

    With a delta base in ``spec`` (and the repository's ``delta_depth`` > 0), each new chunk
    may be stored as a delta against the chunk at the same place in that snapshot
    (``engine/take/deltas.py``).
    """
    t = LocalTake(repo, spec, progress=progress)
    p = plan(states, t.opts)
    t.guard.watch(dtypes_of(p))
    with_base(p, base_manifest(repo, spec.delta_base, spec.run), t.opts)
    t.expect(p.chunks)
    with t:
        stored: list[tuple[Manifest, tuple[str, int]]] = []

        def store_manifest() -> None:  # every chunk is hashed: overlap with the last pack writes
            manifest = t.manifest(p.apps, finish_entries(p))
            stored.append((manifest, t.put_manifest(manifest)))

        t.store(p.chunks, then=store_manifest, defer=True)
        manifest, where = stored[0]
        return TakeResult(t.commit(manifest, stored=where), manifest)


def stage_within(
    states: Mapping[str, Any],
    budget: int,
    arena_for: Callable[[int, bool], StagingArena] = StagingArena,
    fill_later: Callable[[list[tuple[Any, Any]]], None] | None = None,
    inline_bytes: int = 0,
) -> tuple[set[str], int, StagingArena, dict[str, Flat]]:
    """Copy tensors (to CPU) while their total stays within ``budget`` bytes.

    Returns the keys of tensors left uncopied (the caller's own, which must be stored before
    the caller may change them), the bytes copied, the arena the copies were cut from
    (``arena_for(bytes, pinned)``: a repository's reused arena, so a training loop's async
    takes copy into memory already touched; pinned when a tensor to copy is on a GPU) and each
    state flattened, its copied leaves replaced by their copies (what the take plans). Plain
    values need no copy: planning encodes them at once.

    With ``fill_later``, the copies of CPU tensors (and arrays) past ``inline_bytes`` are only
    placed, first: ``fill_later`` gets their ``(place, value)`` pairs for :func:`staging.fill`
    before the other copies are made (so they start at once), and the caller must let those
    copies complete before they are read (planning may run meanwhile), and before the arena
    is used again when this raises.
    """
    flats = {name: flatten(name, sd) for name, sd in states.items()}
    chosen, live, used = _choose(flats, budget)
    arena = arena_for(*_arena_size(chosen))
    try:
        pageable = not arena.pinned  # a pinned arena's copies are issued by arena.copy
        deferring = fill_later is not None and pageable
        later, now = [], []
        for flat, key, value, n in chosen:
            if deferring and _deferrable(value, inline_bytes):
                flat.leaves[key] = arena.place(value)
                later.append((flat.leaves[key], value))
            else:
                now.append((flat, key, value, n))
        if fill_later is not None and pageable:  # deferring, as mypy sees it
            fill_later(later)
        inline = []  # small CPU copies: made here, in one call
        for flat, key, value, n in now:
            if n and pageable and _on_cpu(value):
                flat.leaves[key] = arena.place(value)
                inline.append((flat.leaves[key], value))
            else:
                flat.leaves[key] = arena.copy(value)
        fill(inline)
    finally:
        arena.finish()  # every copy from a device has landed
    return live, used, arena, flats


def _choose(
    flats: Mapping[str, Flat], budget: int
) -> tuple[list[tuple[Flat, str, Any, int]], set[str], int]:
    """The tensors to copy, in order, while their total stays within ``budget``: (flat, key,
    value, its ``arena_bytes``) each; the keys of the others; the bytes chosen."""
    chosen: list[tuple[Flat, str, Any, int]] = []
    live: set[str] = set()
    used = 0
    for flat in flats.values():
        for key, value in flat.leaves.items():
            if not is_array(value):
                continue
            if isinstance(value, torch.Tensor):
                check_tensor(value, key)  # before any copy: a meta tensor must not allocate
            n = (
                value.nbytes
                if not isinstance(value, torch.Tensor)
                else value.numel() * value.element_size()
            )
            if used + n <= budget:
                chosen.append((flat, key, value, arena_bytes(value)))
                used += n
            else:
                live.add(key)
    return chosen, live, used


def _arena_size(chosen: list[tuple[Flat, str, Any, int]]) -> tuple[int, bool]:
    """The bytes of an arena for ``chosen`` and whether it is pinned (a tensor is on a GPU)."""
    on_gpu = any(n and isinstance(v, torch.Tensor) and v.is_cuda for _, _, v, n in chosen)
    return sum(n for _, _, _, n in chosen), on_gpu


def prepare_staging(repo: Repository, states: Mapping[str, Any], budget: int) -> Future[int]:
    """Make ready, behind training, the staging arena an async take of ``states`` under
    ``budget`` (less the take's own buffers) will copy into: allocated (pinned for a state on
    a GPU, shared with knob ``background_process``, whose helper process starts meanwhile) and
    every page touched, on a thread at the lowest priority, then kept by ``repo`` for the next
    async take (:func:`staging.give_back`). The future holds the arena's size in
    bytes, or the error. Nothing is read from the tensors."""
    reserved = reserved_bytes(TakeOptions.of(repo), repo.background_threads, budget)
    flats = {name: flatten(name, sd) for name, sd in states.items()}
    nbytes, pinned = _arena_size(_choose(flats, budget - reserved)[0])
    future: Future[int] = Future()
    repo.open_index_behind()  # the take needs it; not on the lowered thread below

    def run() -> None:
        lower_priority()
        try:
            shared = _offloading(repo, None)
            if shared:
                offload.helper_for(repo).start()  # the helper's imports overlap the touching
            arena = arena_for(repo, nbytes, pinned, shared=shared)
            arena.touch()
            give_back(repo, arena)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the future
            future.set_exception(exc)
        else:
            future.set_result(arena.size)

    repo.staging_prepared = future
    threading.Thread(target=run, name="ckstore-prepare-staging", daemon=True).start()
    return future


def await_prepared(repo: Repository) -> None:
    """Wait for a ``prepare_staging`` still touching its arena (a restore's, started moments
    ago): the take would otherwise fault a second arena of the same size in, against it."""
    pending = repo.staging_prepared
    if pending is not None and not pending.done():
        try:
            pending.result()
        except BaseException:  # noqa: BLE001 - its caller was told; this take makes its own
            pass


def _offloading(repo: Repository, progress: ProgressFn | None) -> bool:
    """Whether an async take into ``repo`` stages into shared memory for the helper process
    (knob ``background_process``; ``offload.py``)."""
    return repo.background_process and progress is None and offload.unavailable(repo) is None


def reserved_bytes(opts: TakeOptions, background_threads: int, budget: int) -> int:
    """The part of an async take's staging ``budget`` kept for its own work (at most all of
    it): ``working_bytes`` on as many workers as either of its parts runs on."""
    return min(budget, replace(opts, threads=max(opts.threads, background_threads)).working_bytes())


def _deferrable(value: Any, inline_bytes: int) -> bool:
    """A CPU value the arena holds whose copy may wait for :func:`staging.fill`: one planning
    stores inline (its own bytes, not its room rounded up to ``ALIGN``, at most
    ``inline_bytes``) is read at once, so it is copied at once."""
    nbytes = (
        value.numel() * value.element_size() if isinstance(value, torch.Tensor) else value.nbytes
    )
    return nbytes > inline_bytes and _on_cpu(value)


def _on_cpu(value: Any) -> bool:
    """A NumPy array, or a tensor on the CPU."""
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


@dataclass
class AsyncTake:
    """A take whose staged part finishes in the background."""

    future: Future[TakeResult]
    staged_bytes: int
    sync_bytes: int
    blocking: BlockingReport | None = None


def take_async(
    repo: Repository,
    states: Mapping[str, Any],
    spec: TakeSpec,
    budget: int,
    progress: ProgressFn | None = None,
    warn: Callable[[], None] | None = None,
) -> AsyncTake:
    """Return once the state at this call is safe: copied within ``budget``, the rest stored.

    ``warn`` (the re-save warning) is issued once the copies are made or under way on other
    threads.

    ``budget`` covers the copies and the take's own buffers (``TakeOptions.working_bytes``,
    kept out of it), so the memory the take adds stays within it. Tensors that fit are copied;
    the others are hashed and written now, at normal priority on every worker, before
    returning (so the caller may change them afterwards). The rest (hashing and writing the
    copies, the manifest, the commit) runs behind training: in a background thread and on
    ``repo.background_threads`` workers at the lowest CPU priority (``engine/background.py``).
    When every tensor was copied, the call does nothing more than copy and plan: the write
    session opens in the background too.
    """
    started = time.perf_counter()
    await_prepared(repo)
    opts = TakeOptions.of(repo, deltas=spec.delta_base is not None)
    threads = repo.background_threads  # what finishes the take; the call itself runs on all
    reserved = reserved_bytes(opts, threads, budget)
    shared = _offloading(repo, progress)
    copying = filling.Copies()  # they land while the take is planned
    try:
        live, used, arena, flats = stage_within(
            states,
            budget - reserved,
            partial(arena_for, repo, shared=shared),
            partial(filling.start, threads=opts.threads, into=copying),
            opts.inline_bytes,
        )
    except BaseException:
        copying.join(quiet=True)  # nothing writes into the arena any more: its error is raised
        raise
    t: LocalTake | None = None
    try:
        try:
            t = LocalTake(repo, spec, opts, progress=progress)
            if warn is not None:
                warn()
            p = plan_flats(flats, t.opts)  # a value the format refuses is refused here, at the call
        except BaseException:
            copying.join(quiet=True)  # what the call raised is raised, not a copy's error
            raise
        copying.join()
        copied = time.perf_counter()
        now = [c for c in p.chunks if c.key in live]
        if now:
            _prepare(t, p)
            t.open()
            t.store(now, defer=True)
    except BaseException:
        try:
            copying.join(quiet=True)  # joined already, unless an interrupt came while joining
        finally:
            if t is not None:
                t.close()
            if copying.done():  # else a filler may still write into it: never reused
                give_back(repo, arena)
        raise
    stored = time.perf_counter()
    blocking = BlockingReport(
        staged_bytes=used,
        sync_bytes=sum(c.nbytes for c in now),
        budget=budget,
        reserved_bytes=reserved,
        copy_seconds=copied - started,
        sync_seconds=stored - copied if now else 0.0,
        seconds=stored - started,
        persist_rate=repo.persist_rate,
    )
    future: Future[TakeResult] = Future()
    previous = _in_call_order(repo, future)
    gate = _Gate()
    try:
        message = (
            offload.job(repo, spec, flats, arena, threads)
            if offload.shareable(flats, arena, live)
            else None
        )
        if message is not None:
            t.close()  # nothing was opened: the helper process opens its own take
            work = partial(_offloaded, repo, message, arena, future, previous)
        else:
            work = partial(_finish, repo, t, p, now, live, threads, arena, future, previous)
        threading.Thread(
            target=gate.run, args=(work,), name="ckstore-async-take", daemon=False
        ).start()
    except BaseException as exc:
        if gate.cancel():  # the handle's next async take waits for this one: it must end
            future.set_exception(exc)
            t.close()
            give_back(repo, arena)
        raise
    return AsyncTake(future, used, blocking.sync_bytes, blocking)


class _Gate:
    """What decides, once, whether an async take's background part runs: the thread that
    runs it (:meth:`run`), or the call when it fails before the thread began (:meth:`cancel`,
    which then ends the take itself). Neither both nor none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "pending"

    def run(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._state != "pending":
                return
            self._state = "running"
        work()

    def cancel(self) -> bool:
        """True if the work will never run (the caller ends the take)."""
        with self._lock:
            if self._state == "pending":
                self._state = "cancelled"
            return self._state == "cancelled"


def _finish(
    repo: Repository,
    t: LocalTake,
    p: Plan,
    now: list[Any],
    live: set[str],
    threads: int,
    arena: StagingArena,
    future: Future[TakeResult],
    previous: Future[TakeResult] | None,
) -> None:
    """The background part of an async take finished in this process: store the copies,
    commit once the handle's previous async take is done, and resolve ``future``."""
    result: TakeResult | None = None
    error: BaseException | None = None
    try:
        t.behind_training(threads)
        if not now:
            _prepare(t, p)
            t.open()
        t.store([c for c in p.chunks if c.key not in live], defer=True)
        manifest = t.manifest(p.apps, finish_entries(p))
        if previous is not None:  # the handle's earlier async take commits first
            wait([previous])
        result = TakeResult(t.commit(manifest), manifest)
    except BaseException as exc:  # surfaced by PendingSnapshot.wait()
        error = exc
    finally:
        t.close()
        give_back(repo, arena)  # nothing reads the copies any more: the next take reuses them
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


_LAST_ASYNC: weakref.WeakKeyDictionary[Repository, Future[TakeResult]] = weakref.WeakKeyDictionary()
_LAST_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's take threads: an async take of the parent in
    flight at the fork never completes there, so a take of the child on the inherited handle
    must not wait for it before committing (it waited forever)."""
    global _LAST_LOCK
    _LAST_LOCK = threading.Lock()
    _LAST_ASYNC.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_call_order(repo: Repository, future: Future[TakeResult]) -> Future[TakeResult] | None:
    """Make ``future`` the repository's last async take; the one before it, whose commit this
    take's waits for. A run's latest snapshot and ``run@step`` are its last commit: two async
    takes in flight at once (the first slower: a bigger state, a slow disk) must commit in the
    order they were called, or a resume takes the older state (the work before the commit
    overlaps as before)."""
    with _LAST_LOCK:
        previous = _LAST_ASYNC.get(repo)
        _LAST_ASYNC[repo] = future
    return previous


def _offloaded(
    repo: Repository,
    message: bytes,
    arena: StagingArena,
    future: Future[TakeResult],
    previous: Future[TakeResult] | None,
) -> None:
    """Send the take to the helper process that stores it (``offload.py``) once the handle's
    previous async take is done (the helper commits its jobs in the order they come, but the
    previous one may be finishing in a thread of this process: a take past its budget), wait
    for it, then finish it here: this repository's hooks after a commit, the guard's memory of
    the run's last manifest."""
    try:
        if previous is not None:
            wait([previous])
        reply = offload.submit(repo, message, arena)
        with repo.activity():  # this process's compaction waits meanwhile, as for a take here
            record, manifest = offload.result_of(reply.result())
    except BaseException as exc:  # surfaced by PendingSnapshot.wait()
        future.set_exception(exc)
        return
    finally:
        give_back(repo, arena)  # the helper is done reading the copies
    repo.committed(record)
    remember(record.manifest_id, manifest)
    future.set_result(TakeResult(record, manifest))


def _prepare(t: LocalTake, p: Plan) -> None:
    """What a take knows of its chunks before storing them: the guard's dtypes, the delta
    bases, the progress total (index and manifest reads: left to the background when the
    call has nothing to store)."""
    t.guard.watch(dtypes_of(p))
    with_base(p, base_manifest(t.repo, t.spec.delta_base, t.spec.run), t.opts)
    t.expect(p.chunks)
