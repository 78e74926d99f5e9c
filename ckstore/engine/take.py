"""A take in one process: turn state dicts into a committed snapshot, now or in the background.

Phases, one function each: state dicts -> plan (flatten, inline small values, cut tensors into
zero-copy grid chunks) -> delta bases -> :class:`~ckstore.engine.local_take.LocalTake` (hash,
pin what the store has, write what it lacks, store the manifest, commit in one index
transaction). Nothing is visible until that commit (I1).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.dtypes import GROUPED, dtype_name
from ..format.grid import make_grid
from ..format.manifest import ChunkRef, Entry, Manifest, TensorEntry, ValueEntry
from ..format.tensors import as_cpu_tensor, byte_view, check_tensor
from ..format.tree import flatten, is_array, unflatten
from ..format.values import encode_value
from ..index import SnapshotRecord
from .deltas import attach_bases
from .device_stage import is_device_tensor
from .local_take import LocalTake
from .packing import Chunk, TakeOptions
from .progress import ProgressFn
from .repository import Repository
from .spec import TakeSpec
from .stage import StagingArena, arena_bytes
from .stateful import RNGState, check_app_state


@dataclass
class _Plan:
    apps: dict[str, Any]
    entries: dict[str, Entry] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Chunk]]] = field(
        default_factory=dict
    )
    keepalive: list[torch.Tensor] = field(default_factory=list)
    tensors: dict[str, tuple[torch.Tensor, str, str]] = field(default_factory=dict)


@dataclass
class TakeResult:
    """What a take wrote (the index records the same figures)."""

    record: SnapshotRecord
    manifest: Manifest


def state_dicts(app_state: Mapping[str, Any]) -> dict[str, Any]:
    """Call ``state_dict()`` on every stateful in ``app_state``; refuse anything else.

    :class:`RNGState` entries are captured first and put back once the others are done, so
    random numbers drawn inside other ``state_dict()`` calls leave no trace (TorchSnapshot's
    order). The result keeps ``app_state``'s order.
    """
    check_app_state(app_state)
    rng = {name: obj for name, obj in app_state.items() if isinstance(obj, RNGState)}
    captured = {name: obj.state_dict() for name, obj in rng.items()}
    others = {name: obj.state_dict() for name, obj in app_state.items() if name not in rng}
    for name, obj in rng.items():
        obj.load_state_dict(captured[name])  # undo draws made by the other statefuls
    return {name: captured[name] if name in captured else others[name] for name in app_state}


def plan(states: Mapping[str, Any], opts: TakeOptions) -> _Plan:
    """Flatten every state and cut its tensors into grid chunks (zero-copy views)."""
    p = _Plan(apps={})
    for name, sd in states.items():
        flat = flatten(name, sd)
        p.apps[name] = flat.tree
        for key, value in flat.leaves.items():
            if is_array(value):
                _plan_tensor(p, key, value, opts)
            else:
                p.entries[key] = ValueEntry(encode_value(value, key))
    return p


def _plan_tensor(p: _Plan, key: str, value: Any, opts: TakeOptions) -> None:
    device = str(value.device) if isinstance(value, torch.Tensor) else "cpu"
    container = "torch" if isinstance(value, torch.Tensor) else "numpy"
    nbytes = (
        value.numel() * value.element_size() if isinstance(value, torch.Tensor) else value.nbytes
    )
    on_device = is_device_tensor(value) and nbytes > opts.inline_bytes
    # A device tensor stays where it is: its chunks are copied to host buffers batch by batch.
    t = value.detach().contiguous() if on_device else as_cpu_tensor(value, key)
    name = dtype_name(t.dtype, key)
    flat = t.reshape(-1).view(torch.uint8) if on_device else None
    view = memoryview(b"") if on_device else byte_view(t)
    p.keepalive.append(t)
    shape = tuple(t.shape)
    if not on_device and len(view) <= opts.inline_bytes:
        p.entries[key] = TensorEntry(
            name, shape, data=bytes(view), container=container, device=device
        )
        return
    grid = make_grid(shape, t.element_size(), opts.chunk_bytes)
    boxes = []
    for offsets, sizes in grid.boxes():
        start, stop = grid.byte_range(offsets, sizes)
        if flat is not None:
            chunk = Chunk(key, view, t.element_size(), name in GROUPED, source=flat[start:stop])
        else:
            chunk = Chunk(key, view[start:stop], t.element_size(), name in GROUPED)
        p.chunks.append(chunk)
        boxes.append((offsets, sizes, chunk))
    p.boxes[key] = boxes
    p.tensors[key] = (t, container, device)
    p.entries[key] = TensorEntry(name, shape, (), grid.block, container=container, device=device)


def dtypes_of(p: _Plan) -> dict[str, str]:
    """Chunked key -> dtype name (what the take's guard measures)."""
    return {
        key: e.dtype
        for key, e in p.entries.items()
        if key in p.boxes and isinstance(e, TensorEntry)
    }


def with_base(p: _Plan, base: Manifest | None, opts: TakeOptions) -> None:
    """Give the plan's chunks their candidate bases in ``base`` (when deltas are on)."""
    if base is not None and opts.delta_depth > 0:
        attach_bases(p.boxes, p.entries, base)


def finish_entries(p: _Plan) -> dict[str, Entry]:
    """The plan's entries, each chunked tensor's placeholder replaced by one listing its chunk
    ids (every chunk is hashed)."""
    for key, boxes in p.boxes.items():
        e = p.entries[key]
        assert isinstance(e, TensorEntry)
        refs = tuple(ChunkRef(o, s, c.id) for o, s, c in boxes)
        p.entries[key] = TensorEntry(
            e.dtype, e.shape, refs, e.block, container=e.container, device=e.device
        )
    return p.entries


def take(
    repo: Repository, states: Mapping[str, Any], spec: TakeSpec, progress: ProgressFn | None = None
) -> TakeResult:
    """Store ``states`` (already-called state dicts) as one committed snapshot.

    With a delta base in ``spec`` (and the repository's ``delta_depth`` > 0), each new chunk
    may be stored as a delta against the chunk at the same place in that snapshot
    (``engine.deltas``).
    """
    t = LocalTake(repo, spec, progress=progress)
    p = plan(states, t.opts)
    t.guard.watch(dtypes_of(p))
    with_base(p, repo.delta_manifest(spec.delta_base, spec.run), t.opts)
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
    staged, live, used, arena = stage_within(states, budget, repo.staging_arena)
    t = LocalTake(repo, spec, progress=progress)
    p = plan(staged, t.opts)
    t.guard.watch(dtypes_of(p))
    with_base(p, repo.delta_manifest(spec.delta_base, spec.run), t.opts)
    t.expect(p.chunks)
    now = [c for c in p.chunks if c.key in live]
    t.open()
    try:
        t.store(now, defer=True)
    except BaseException:
        t.close()
        repo.release_staging(arena)
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
            repo.release_staging(
                arena
            )  # nothing reads the copies any more: the next take reuses them
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    threading.Thread(target=finish, name="ckstore-async-take", daemon=False).start()
    return AsyncTake(future, used, sum(c.nbytes for c in now))
