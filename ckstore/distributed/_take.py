"""The distributed take: every rank writes its share of the chunks; rank 0 commits once.

Phases, each closed by one collective so that a failure anywhere stops every rank at the
same point (no rank commits or waits on a rank that gave up):

1. plan (local): flatten each rank's state; describe every leaf (DTensor shard box,
   replicated tensor, per-rank tensor or plain value). -> all_gather descriptions.
2. assign (same on every rank, from the descriptions): cut each tensor by the chunk grid of
   its GLOBAL shape; a DTensor's blocks are cut again by each shard's box, each distinct box
   written by one of the ranks holding it; replicated tensors' blocks are spread over all
   ranks by bytes (``_plan.plan``, cached across takes of the same layout). Each rank hashes
   what it was given (and all of its per-rank tensors).
   -> all_gather chunk lists; each distinct chunk id gets exactly one writer.
3. write (local, under this rank's own lease): look up (and pin) the chunks this rank
   writes, write the missing ones (packs durable, then indexed). -> all_gather status.
4. commit (rank 0): build the one manifest, store it, commit it in one index transaction.
   -> broadcast the record or the error. Other ranks end their sessions only now, so their
   pins protect what they wrote or reused until the snapshot references it.

Any failure raises :class:`DistributedError` on every rank, naming the failed ranks and their
causes; nothing is committed unless every rank succeeded.
"""

from __future__ import annotations

import base64
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import blake3

from ..engine.lease import Lease
from ..engine.packing import TakeOptions, _Chunk, write_missing
from ..engine.take import commit_manifest, hash_chunks, state_dicts
from ..errors import DistributedError
from ..format.dtypes import GROUPED, itemsize
from ..format.grid import Box, make_grid
from ..format.manifest import (
    ChunkRef,
    Entry,
    Manifest,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    canonical_json,
    entry_digest,
    snapshot_header,
)
from ..format.tensors import byte_view
from ..index import SnapshotRecord
from ._classify import (
    DTENSOR,
    LOCAL,
    REPLICATED,
    VALUE,
    _classify,
    _coalesce_replicated,
    _ddp_apps,
    _Local,
)
from ._comm import Comm, failure, raise_failed
from ._plan import Loads, layout_digest, plan


def take(
    store: Any,
    app_state: Mapping[str, Any] | None,
    opts: TakeOptions,
    *,
    run: str,
    step: int | None,
    tags: tuple[str, ...],
    metadata: dict[str, Any],
    name: str | None = None,
    replicated: Sequence[str] = (),
    pg: Any = None,
    timeout: float | None = None,
    states: Mapping[str, Any] | None = None,
    comm: Comm | None = None,
    ddp: set[str] | None = None,
) -> tuple[SnapshotRecord, Manifest | None]:
    """Take one snapshot with every rank; returns the committed record on every rank.

    ``states`` (already-called, e.g. staged, state dicts) replaces ``app_state`` when given;
    then ``ddp`` names the app_state entries that were DistributedDataParallel modules.
    """
    comm = comm or Comm(pg, timeout)
    started = time.time()

    # 1. plan
    local: _Local | None = None
    try:
        if states is None:
            assert app_state is not None
            ddp = _ddp_apps(app_state)
            states = state_dicts(app_state)
        else:
            ddp = ddp or set()
        local = _classify(states, ddp, tuple(replicated), opts)
        msg: dict[str, Any] = {
            "ok": True,
            "tree": blake3.blake3(canonical_json(local.apps)).hexdigest(),
            "leaves": {k: leaf.desc for k, leaf in local.leaves.items()},
        }
        msg["layout"] = layout_digest(msg["leaves"])
    except Exception as exc:
        msg = failure(exc)
    descs = comm.all_gather_json(msg, "planning")
    raise_failed(descs, "distributed take (planning)")
    assert local is not None
    layout = plan(descs, opts)
    _coalesce_replicated(layout.demoted, local, comm.rank)
    keys = list(layout.keys)

    # 2. assign and hash
    try:
        mine = layout.assignment[comm.rank]
        _cut_chunks(local, mine, opts)
        with ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="ckstore") as pool:
            hash_chunks([c for _, _, c in local.chunks], pool)
        lists: dict[str, list[Any]] = defaultdict(list)
        for key, (o, s), c in local.chunks:
            lists[key].append([list(o), list(s), c.id])
        distinct = {c.id: len(c.view) for _, _, c in local.chunks}
        msg = {"ok": True, "chunks": lists, "bytes": sum(distinct.values())}
    except Exception as exc:
        msg = failure(exc)
    results = comm.all_gather_json(msg, "hashing")
    raise_failed(results, "distributed take (hashing)")
    owners = _writers(results, descs, comm.world)

    # 3. write, 4. commit
    with ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="ckstore") as pool:
        lease = Lease(store.index, opts.lease_seconds)
        entered = False
        try:
            try:
                lease.__enter__()
                entered = True
                stats = _write_mine(store, lease, local, owners, comm.rank, opts, pool)
                msg = {"ok": True, "stats": stats}
            except Exception as exc:
                msg = failure(exc)
            statuses = comm.all_gather_json(msg, "writing chunks")
            raise_failed(statuses, "distributed take (writing)")
            if comm.rank == 0:
                try:
                    record, manifest = _commit(
                        store, lease, local, descs, keys, results, statuses, opts,
                        run=run, step=step, tags=tags, metadata=metadata, name=name,
                        started=started, world=comm.world,
                    )
                    lease.committed = True
                    reply = {"ok": True, "record": asdict(record)}
                except Exception as exc:
                    reply = failure(exc)
            else:
                reply = None
            reply = comm.broadcast_json(reply, "commit")
            if not reply.get("ok"):
                err = DistributedError(f"distributed take: commit failed on rank 0: {reply.get('error')}")
                err.ranks = [0]  # type: ignore[attr-defined]
                err.causes = {0: reply.get("error")}  # type: ignore[attr-defined]
                raise err
            if comm.rank != 0:
                try:
                    store.index.end_session(lease.id, "committed")
                    lease.committed = True
                except Exception:  # noqa: BLE001 - the session expires by itself; the snapshot is committed
                    pass
                return SnapshotRecord(**reply["record"]), None
            return record, manifest
        finally:
            if entered:
                lease.__exit__(None, None, None)


_BACKGROUND: list[Any] = []


def background() -> Any:
    """The one thread that runs this process's async distributed takes, in call order.

    One thread keeps the order of collectives the same on every rank.
    """
    if not _BACKGROUND:
        _BACKGROUND.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckstore-dist-async"))
    return _BACKGROUND[0]


def _cut_chunks(local: _Local, mine: Sequence[tuple[str, Box]], opts: TakeOptions) -> None:
    """Zero-copy (where contiguous) byte views of this rank's pieces and per-rank tensors."""
    for key, (po, ps) in mine:
        leaf = local.leaves[key]
        assert leaf.tensor is not None
        t = leaf.tensor
        if leaf.kind == DTENSOR:
            assert leaf.box is not None
            sub = t[tuple(slice(o - b, o - b + s) for o, b, s in zip(po, leaf.box[0], ps))]
        else:
            sub = t[tuple(slice(o, o + s) for o, s in zip(po, ps))]
        local.chunks.append((key, (po, ps), _Chunk(key, byte_view(sub), t.element_size(), leaf.desc["dtype"] in GROUPED)))
    for key, leaf in local.leaves.items():
        if leaf.kind != LOCAL or "data" in leaf.desc:
            continue
        lt = leaf.tensor
        assert lt is not None
        view = byte_view(lt)
        grid = make_grid(tuple(lt.shape), lt.element_size(), opts.chunk_bytes)
        for offsets, sizes in grid.boxes():
            start, stop = grid.byte_range(offsets, sizes)
            local.chunks.append((key, (offsets, sizes), _Chunk(key, view[start:stop], lt.element_size(), leaf.desc["dtype"] in GROUPED)))


def _writers(results: list[dict[str, Any]], descs: list[dict[str, Any]], world: int) -> dict[str, int]:
    """One writer per distinct chunk id: its only holder, or the least-loaded of its holders.

    Linear in the gathered chunk lists, and cheap per chunk: an id held by one rank (nearly
    all of them) costs one dict lookup. Each rank's load starts as the bytes of the distinct
    ids it hashed (``bytes`` in its message) less those held by other ranks too; those shared
    ids then go, in id order, to the least-loaded of their holders.
    """
    first: dict[str, int] = {}
    shared: dict[str, set[int]] = {}
    nbytes: dict[str, int] = {}
    for r, res in enumerate(results):
        leaves = descs[r]["leaves"]
        for key, lst in res["chunks"].items():
            for _, extent, cid in lst:
                holder = first.setdefault(cid, r)
                if holder != r:
                    shared.setdefault(cid, {holder}).add(r)
                    nbytes[cid] = math.prod(extent) * itemsize(leaves[key]["dtype"])
    if not shared:
        return first
    loads = Loads(world)
    loads.load = [int(res["bytes"]) for res in results]
    for cid, hs in shared.items():
        for r in hs:
            loads.load[r] -= nbytes[cid]
    loads.reset()
    owners = first
    for cid in sorted(shared):
        hs = shared[cid]
        r = loads.least(None if len(hs) == world else sorted(hs))
        owners[cid] = r
        loads.add(r, nbytes[cid])
    return owners


def _write_mine(
    store: Any, lease: Lease, local: _Local, owners: dict[str, int], rank: int, opts: TakeOptions, pool: ThreadPoolExecutor
) -> dict[str, int]:
    """Pin what the store has of this rank's chunks, write the rest; return the figures."""
    unique = {c.id: c for _, _, c in local.chunks if owners.get(c.id) == rank}
    found = store.index.lookup_chunks(lease.id, list(unique))
    missing = [c for cid, c in unique.items() if cid not in found]
    stats = write_missing(store.objects, store.index, lease.id, missing, opts, pool)
    if lease.error is not None:
        raise lease.error
    return {
        "new_bytes": stats.new_bytes,
        "new_chunks": stats.new_chunks,
        "reused_chunks": len(found),
        "written_raw_bytes": sum(len(c.view) for c in missing),
        "hashed_bytes": sum(len(c.view) for _, _, c in local.chunks),
    }


def _commit(
    store: Any,
    lease: Lease,
    local: _Local,
    descs: list[dict[str, Any]],
    keys: list[str],
    results: list[dict[str, Any]],
    statuses: list[dict[str, Any]],
    opts: TakeOptions,
    *,
    run: str,
    step: int | None,
    tags: tuple[str, ...],
    metadata: dict[str, Any],
    name: str | None,
    started: float,
    world: int,
) -> tuple[SnapshotRecord, Manifest]:
    """Rank 0: build the one manifest from every rank's pieces, store it, commit it."""
    entries = {key: _entry(key, descs, results, opts) for key in keys}
    ranks = [s["stats"] for s in statuses]
    header = snapshot_header(
        run=run, step=step, created_at=started, metadata=metadata, name=name, session=lease.id,
        world_size=world, ranks=ranks,
    )
    manifest = Manifest(local.apps, entries, header)
    committed = commit_manifest(
        store.objects, store.index, lease.id, manifest, tags,
        new_bytes=sum(r["new_bytes"] for r in ranks),
        new_chunks=sum(r["new_chunks"] for r in ranks),
        reused_chunks=sum(r["reused_chunks"] for r in ranks),
        validate=True,  # every tensor's pieces, from every rank, must tile it
    )
    return committed, manifest


def _entry(key: str, descs: list[dict[str, Any]], results: list[dict[str, Any]], opts: TakeOptions) -> Entry:
    ds = [d["leaves"][key] for d in descs]
    kind = ds[0]["t"]
    if kind in (DTENSOR, REPLICATED):
        x = ds[0]
        shape = tuple(x["shape"])
        if kind == REPLICATED and "data" in x:
            return TensorEntry(x["dtype"], shape, data=base64.b64decode(x["data"]), container=x["container"], device=x["device"])
        refs = sorted(
            (ChunkRef(tuple(o), tuple(s), cid) for res in results for o, s, cid in res["chunks"].get(key, ())),
            key=lambda c: c.offsets,
        )
        block = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes).block
        return TensorEntry(x["dtype"], shape, tuple(refs), block, container=x["container"], device=x["device"])
    per = [_own_entry(key, x, res, opts) for x, res in zip(ds, results)]
    if len({entry_digest(e) for e in per}) == 1:
        return per[0]  # the same on every rank: one entry, not one per rank
    return PerRankEntry(tuple(per))


def _own_entry(key: str, x: dict[str, Any], res: dict[str, Any], opts: TakeOptions) -> TensorEntry | ValueEntry:
    if x["t"] == VALUE:
        return ValueEntry(x["value"])
    shape = tuple(x["shape"])
    if "data" in x:
        return TensorEntry(x["dtype"], shape, data=base64.b64decode(x["data"]), container=x["container"], device=x["device"])
    refs = tuple(ChunkRef(tuple(o), tuple(s), cid) for o, s, cid in res["chunks"].get(key, ()))
    block = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes).block
    return TensorEntry(x["dtype"], shape, refs, block, container=x["container"], device=x["device"])
