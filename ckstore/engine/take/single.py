"""The single-process take: state dicts to one committed snapshot, now or in the background.

Phases, one function each: state dicts -> plan (``plan.py``) -> delta bases ->
:class:`~ckstore.engine.take.local.LocalTake` (hash, pin what the store has, write what it
lacks, store the manifest, commit in one index transaction). Nothing is visible until that
commit (I1).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...format.manifest import Manifest
from ...format.tensors import check_tensor
from ...format.tree import flatten, is_array, unflatten
from ...index import SnapshotRecord
from ..progress import ProgressFn
from ..repository import Repository
from .deltas import base_manifest
from .local import LocalTake
from .plan import dtypes_of, finish_entries, plan, with_base
from .spec import TakeSpec
from .staging import StagingArena, arena_bytes, arena_for, give_back


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
) -> tuple[dict[str, Any], set[str], int, StagingArena]:
    """Copy tensors (to CPU) while their total stays within ``budget`` bytes.

    Returns the states rebuilt around the copies, the keys of tensors left uncopied (the
    caller's own, which must be stored before the caller may change them), the bytes copied
    and the arena the copies were cut from (``arena_for(bytes, pinned)``: a repository's reused
    arena, so a training loop's async takes copy into memory already touched; pinned when a
    tensor to copy is on a GPU). Plain values need no copy: planning encodes them at once.
    """
    flats = {name: flatten(name, sd) for name, sd in states.items()}
    chosen: list[tuple[Any, str, Any]] = []
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
                chosen.append((flat, key, value))
                used += n
            else:
                live.add(key)
    on_gpu = any(isinstance(v, torch.Tensor) and v.is_cuda and arena_bytes(v) for _, _, v in chosen)
    arena = arena_for(sum(arena_bytes(v) for _, _, v in chosen), on_gpu)
    try:
        for flat, key, value in chosen:
            flat.leaves[key] = arena.copy(value)
    finally:
        arena.finish()  # every copy from a device has landed
    out = {name: unflatten(flat.tree, flat.leaves.__getitem__) for name, flat in flats.items()}
    return out, live, used, arena


@dataclass
class AsyncTake:
    """A take whose staged part finishes in the background."""

    future: Future[TakeResult]
    staged_bytes: int
    sync_bytes: int


def take_async(
    repo: Repository,
    states: Mapping[str, Any],
    spec: TakeSpec,
    budget: int,
    progress: ProgressFn | None = None,
) -> AsyncTake:
    """Return once the state at this call is safe: copied within ``budget``, the rest stored.

    Tensors that fit the staging budget are copied; the others are hashed and written now,
    before returning (so the caller may change them afterwards). Hashing and writing of the
    copies, the manifest and the commit run in a background thread in the same session.
    """
    staged, live, used, arena = stage_within(states, budget, partial(arena_for, repo))
    t = LocalTake(repo, spec, progress=progress)
    p = plan(staged, t.opts)
    t.guard.watch(dtypes_of(p))
    with_base(p, base_manifest(repo, spec.delta_base, spec.run), t.opts)
    t.expect(p.chunks)
    now = [c for c in p.chunks if c.key in live]
    t.open()
    try:
        t.store(now, defer=True)
    except BaseException:
        t.close()
        give_back(repo, arena)
        raise
    future: Future[TakeResult] = Future()

    def finish() -> None:
        result: TakeResult | None = None
        error: BaseException | None = None
        try:
            t.store([c for c in p.chunks if c.key not in live], defer=True)
            manifest = t.manifest(p.apps, finish_entries(p))
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

    threading.Thread(target=finish, name="ckstore-async-take", daemon=False).start()
    return AsyncTake(future, used, sum(c.nbytes for c in now))
