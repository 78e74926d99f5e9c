"""Take: turn an app_state into a committed snapshot, writing only chunks the store lacks.

Phases, one function each: flatten -> plan chunks -> hash -> ask the index (pinning what it
has) -> encode and pack what is missing (packs durable before they are indexed) -> store the
manifest -> commit in one index transaction. Nothing is visible until that commit (I1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import objects
from ..format.dtypes import GROUPED, dtype_name
from ..format.grid import make_grid
from ..format.manifest import (
    ChunkRef,
    Entry,
    Manifest,
    TensorEntry,
    ValueEntry,
    entry_digest,
    snapshot_header,
)
from ..format.tensors import as_cpu_tensor, byte_view, check_tensor
from ..format.tree import flatten, is_array, unflatten
from ..format.values import encode_value
from ..index import EntryRecord, SnapshotRecord
from .deltas import attach_bases, resolve_bases
from .device_stage import DeviceStager, is_device_tensor
from .lease import Lease
from .packing import TakeOptions, _batches, _Chunk, _PackPipeline, _WriteStats
from .stateful import RNGState, check_app_state

HASH_BATCH_BYTES = 128 << 20
"""A take hashes and looks up chunks in batches of about this many bytes..."""
HASH_BATCH_CHUNKS = 4096
"""...or of at most this many chunks."""
FIRST_BATCH_BYTES = 16 << 20
"""The first batch is this small (each next one twice the last), so encoding and pack writes
start early instead of after a whole batch was hashed."""


@dataclass
class _Plan:
    apps: dict[str, Any]
    entries: dict[str, Entry] = field(default_factory=dict)
    chunks: list[_Chunk] = field(default_factory=list)
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], _Chunk]]] = field(default_factory=dict)
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
    nbytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else value.nbytes
    on_device = is_device_tensor(value) and nbytes > opts.inline_bytes
    # A device tensor stays where it is: its chunks are copied to host buffers batch by batch.
    t = value.detach().contiguous() if on_device else as_cpu_tensor(value, key)
    name = dtype_name(t.dtype, key)
    flat = t.reshape(-1).view(torch.uint8) if on_device else None
    view = memoryview(b"") if on_device else byte_view(t)
    p.keepalive.append(t)
    shape = tuple(t.shape)
    if not on_device and len(view) <= opts.inline_bytes:
        p.entries[key] = TensorEntry(name, shape, data=bytes(view), container=container, device=device)
        return
    grid = make_grid(shape, t.element_size(), opts.chunk_bytes)
    boxes = []
    for offsets, sizes in grid.boxes():
        start, stop = grid.byte_range(offsets, sizes)
        if flat is not None:
            chunk = _Chunk(key, view, t.element_size(), name in GROUPED, source=flat[start:stop])
        else:
            chunk = _Chunk(key, view[start:stop], t.element_size(), name in GROUPED)
        p.chunks.append(chunk)
        boxes.append((offsets, sizes, chunk))
    p.boxes[key] = boxes
    p.tensors[key] = (t, container, device)
    p.entries[key] = TensorEntry(name, shape, (), grid.block, container=container, device=device)


def with_base(p: _Plan, base: Manifest | None, opts: TakeOptions) -> None:
    """Give the plan's chunks their candidate bases in ``base`` (when deltas are on)."""
    if base is not None and opts.delta_depth > 0:
        attach_bases(p.boxes, p.entries, base)


def hash_chunks(chunks: list[_Chunk], pool: ThreadPoolExecutor) -> None:
    """Fill in every chunk's id (blake3 of its raw bytes), in parallel."""
    for chunk, cid in zip(chunks, pool.map(lambda c: objects.chunk_id(c.ready()), chunks)):
        chunk.id = cid


def finish_entries(p: _Plan) -> None:
    """Replace each chunked tensor's placeholder entry by one listing its chunk ids."""
    for key, boxes in p.boxes.items():
        e = p.entries[key]
        assert isinstance(e, TensorEntry)
        refs = tuple(ChunkRef(o, s, c.id) for o, s, c in boxes)
        p.entries[key] = TensorEntry(e.dtype, e.shape, refs, e.block, container=e.container, device=e.device)


def entry_records(manifest: Manifest) -> list[EntryRecord]:
    """Index rows for a manifest's entries (kind, dtype, shape, size, digest)."""
    return [
        EntryRecord(key, e.kind, e.dtype, e.shape, e.nbytes, entry_digest(e))
        for key, e in manifest.entries.items()
    ]


@dataclass
class _Acc:
    """What a take has stored so far: unique chunk ids handled, how many the index had."""

    seen: dict[str, _Chunk] = field(default_factory=dict)
    found: int = 0
    stats: _WriteStats = field(default_factory=_WriteStats)


def store_chunks(
    objs: objects.ObjectStore,
    index: Any,
    session: str,
    chunks: list[_Chunk],
    opts: TakeOptions,
    pool: ThreadPoolExecutor,
    acc: _Acc,
    then: Any = None,
) -> None:
    """Hash ``chunks``, pin those the index has, write those it lacks (each id once per take).

    ``then`` (a callable) runs once every chunk is hashed and queued, while the last packs are
    still being written (a take stores its manifest there).

    Works in batches of about ``HASH_BATCH_BYTES``: while one batch's missing chunks are
    encoded and written, the next is hashed and looked up, so hashing overlaps the writes.
    Chunks of device tensors are copied into bounded host pools batch by batch
    (``device_stage``), each copy overlapping the hashing of the chunks before it.
    """
    stager = DeviceStager(opts.chunk_bytes)
    device = any(c.source is not None for c in chunks)
    max_bytes = min(HASH_BATCH_BYTES, stager.batch_bytes) if device else HASH_BATCH_BYTES
    max_count = min(HASH_BATCH_CHUNKS, stager.batch_chunks) if device else HASH_BATCH_CHUNKS
    try:
        with _PackPipeline(objs, index, session, opts, pool) as pipe:
            for batch in _batches(chunks, max_bytes, max_count, FIRST_BATCH_BYTES):
                stager.stage(batch)
                hash_chunks(batch, pool)
                new: dict[str, _Chunk] = {}
                for c in batch:
                    if c.id not in acc.seen:
                        new.setdefault(c.id, c)
                acc.seen.update(new)
                found = index.lookup_chunks(session, list(new))
                acc.found += len(found)
                missing = [c for cid, c in new.items() if cid not in found]
                resolve_bases(index, session, missing, opts.delta_depth)
                for c in missing:
                    pipe.push(c)
                if device:
                    pipe.drain()  # the batch's staged bytes are encoded: its buffers are free
                    stager.release()
            if then is not None:
                then()
    finally:
        stager.close()
    for name in ("new_bytes", "new_chunks", "delta_chunks", "delta_raw_bytes", "delta_bytes"):
        setattr(acc.stats, name, getattr(acc.stats, name) + getattr(pipe.stats, name))


@dataclass
class _Header:
    """What a take's manifest header records besides its entries."""

    run: str
    step: int | None
    metadata: dict[str, Any]
    name: str | None
    started: float

    def manifest(self, p: _Plan, session: str) -> Manifest:
        """The manifest of ``p`` (every chunk hashed) under this header."""
        finish_entries(p)
        header = snapshot_header(run=self.run, step=self.step, created_at=self.started,
                                 metadata=self.metadata, name=self.name, session=session)
        return Manifest(p.apps, p.entries, header)


def commit(
    objs: objects.ObjectStore,
    index: Any,
    lease: Lease,
    p: _Plan,
    acc: _Acc,
    *,
    run: str,
    step: int | None,
    tags: tuple[str, ...],
    metadata: dict[str, Any],
    name: str | None,
    started: float,
    stored: tuple[Manifest, str, int] | None = None,
) -> TakeResult:
    """Store the manifest (unless ``stored`` already: manifest, id, size), then commit the
    snapshot in one index transaction."""
    manifest = stored[0] if stored else _Header(run, step, metadata, name, started).manifest(p, lease.id)
    record = commit_manifest(
        objs, index, lease.id, manifest, tags,
        new_bytes=acc.stats.new_bytes, new_chunks=acc.stats.new_chunks, reused_chunks=acc.found,
        stored=stored[1:] if stored else None,
    )
    lease.committed = True
    return TakeResult(record, manifest)


def commit_manifest(
    objs: objects.ObjectStore,
    index: Any,
    session: str,
    manifest: Manifest,
    tags: tuple[str, ...],
    *,
    new_bytes: int,
    new_chunks: int,
    reused_chunks: int,
    validate: bool = False,
    stored: tuple[str, int] | None = None,
) -> SnapshotRecord:
    """Store ``manifest`` (whose header names run, step, time, metadata, name) and commit it.

    The snapshot id is the manifest id; the index transaction references every chunk the
    manifest names, so nothing it needs can be collected once it is visible. ``validate``
    parses the serialised manifest back first (a manifest assembled from several ranks'
    pieces must tile every tensor), raising CorruptionError before anything is stored.
    ``stored`` (id, size in bytes): the manifest is stored already (:func:`put_manifest`).
    """
    header = manifest.snapshot or {}
    if stored is None:
        manifest_id, size = put_manifest(objs, manifest, validate)
    else:
        manifest_id, size = stored
    record = SnapshotRecord(
        id=manifest_id,
        run=header["run"],
        step=header.get("step"),
        parent_id=None,
        manifest_id=manifest_id,
        created_at=header["created_at"],
        metadata=dict(header.get("metadata") or {}),
        logical_bytes=manifest.logical_bytes(),
        new_bytes=new_bytes,
        new_chunks=new_chunks,
        reused_chunks=reused_chunks,
        name=header.get("name"),
        world_size=int(header.get("world_size", 1)),
    )
    ids = sorted(manifest.chunk_ids())
    return index.commit_snapshot(session, record, entry_records(manifest), ids, size, tags)


def put_manifest(objs: objects.ObjectStore, manifest: Manifest, validate: bool = False) -> tuple[str, int]:
    """Store ``manifest`` as a blob (durable); its id and size. Visible to nobody until a
    commit names it; if none does, GC removes it as an orphan."""
    raw = manifest.to_json()
    if validate:
        Manifest.from_json(raw, "the manifest being committed")
    return objs.put_blob("manifests", raw), len(raw)


def take(
    objs: objects.ObjectStore,
    index: Any,
    states: Mapping[str, Any],
    opts: TakeOptions,
    *,
    run: str,
    step: int | None,
    tags: tuple[str, ...],
    metadata: dict[str, Any],
    name: str | None = None,
    base: Manifest | None = None,
) -> TakeResult:
    """Store ``states`` (already-called state dicts) as one committed snapshot.

    With ``base`` (and ``opts.delta_depth`` > 0), each new chunk may be stored as a delta
    against the chunk at the same place in that snapshot (``engine.deltas``).
    """
    started = time.time()
    p = plan(states, opts)
    with_base(p, base, opts)
    acc = _Acc()
    head = _Header(run, step, metadata, name, started)
    with ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="ckstore") as pool:
        with Lease(index, opts.lease_seconds) as lease:
            stored: list[tuple[Manifest, str, int]] = []

            def store_manifest() -> None:  # every chunk is hashed: overlap with the last pack writes
                manifest = head.manifest(p, lease.id)
                stored.append((manifest, *put_manifest(objs, manifest)))

            store_chunks(objs, index, lease.id, p.chunks, opts, pool, acc, then=store_manifest)
            return commit(objs, index, lease, p, acc, run=run, step=step, tags=tags, metadata=metadata,
                          name=name, started=started, stored=stored[0] if stored else None)


def stage_within(states: Mapping[str, Any], budget: int) -> tuple[dict[str, Any], set[str], int]:
    """Copy tensors (to CPU) while their total stays within ``budget`` bytes.

    Returns the states rebuilt around the copies, the keys of tensors left uncopied (the
    caller's own, which must be stored before the caller may change them), and the bytes
    copied. Plain values need no copy: planning encodes them at once.
    """
    out: dict[str, Any] = {}
    live: set[str] = set()
    used = 0
    for name, sd in states.items():
        flat = flatten(name, sd)
        for key, value in flat.leaves.items():
            if not is_array(value):
                continue
            if isinstance(value, torch.Tensor):
                check_tensor(value, key)  # before any copy: a meta tensor must not allocate
            n = value.nbytes if not isinstance(value, torch.Tensor) else value.numel() * value.element_size()
            if used + n <= budget:
                flat.leaves[key] = value.copy() if not isinstance(value, torch.Tensor) else value.detach().to("cpu", copy=True)
                used += n
            else:
                live.add(key)
        out[name] = unflatten(flat.tree, flat.leaves.__getitem__)
    return out, live, used


@dataclass
class AsyncTake:
    """A take whose staged part finishes in the background."""

    future: Future[TakeResult]
    staged_bytes: int
    sync_bytes: int


def take_async(
    objs: objects.ObjectStore,
    index: Any,
    states: Mapping[str, Any],
    opts: TakeOptions,
    budget: int,
    *,
    run: str,
    step: int | None,
    tags: tuple[str, ...],
    metadata: dict[str, Any],
    name: str | None = None,
    base: Manifest | None = None,
) -> AsyncTake:
    """Return once the state at this call is safe: copied within ``budget``, the rest stored.

    Tensors that fit the staging budget are copied; the others are hashed and written now,
    before returning (so the caller may change them afterwards). Hashing and writing of the
    copies, the manifest and the commit run in a background thread under the same lease.
    """
    started = time.time()
    staged, live, used = stage_within(states, budget)
    p = plan(staged, opts)
    with_base(p, base, opts)
    acc = _Acc()
    pool = ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="ckstore")
    lease = Lease(index, opts.lease_seconds).__enter__()
    now = [c for c in p.chunks if c.key in live]
    try:
        store_chunks(objs, index, lease.id, now, opts, pool, acc)
    except BaseException:
        lease.__exit__(None, None, None)
        pool.shutdown()
        raise
    future: Future[TakeResult] = Future()

    def finish() -> None:
        try:
            later = [c for c in p.chunks if c.key not in live]
            store_chunks(objs, index, lease.id, later, opts, pool, acc)
            future.set_result(commit(objs, index, lease, p, acc, run=run, step=step, tags=tags, metadata=metadata, name=name, started=started))
        except BaseException as exc:  # surfaced by PendingSnapshot.wait()
            future.set_exception(exc)
        finally:
            lease.__exit__(None, None, None)
            pool.shutdown()

    threading.Thread(target=finish, name="ckstore-async-take", daemon=False).start()
    return AsyncTake(future, used, sum(c.nbytes for c in now))
