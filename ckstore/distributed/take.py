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
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import blake3

from ..engine.local_take import LocalTake
from ..engine.packing import Chunk, TakeOptions
from ..engine.repository import Repository
from ..engine.spec import TakeSpec
from ..engine.stage import stage
from ..engine.take import state_dicts
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
)
from ..format.tensors import byte_view
from ..index import SnapshotRecord
from ._classify import (
    DTENSOR,
    LOCAL,
    REPLICATED,
    VALUE,
    Local,
    classify,
    coalesce_replicated,
    ddp_apps,
)
from ._plan import Loads, layout_digest, plan
from .comm import Comm, phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Committed = tuple[SnapshotRecord, "Manifest | None"]


def take(
    repo: Repository,
    states: Mapping[str, Any],
    spec: TakeSpec,
    comm: Comm,
    ddp: set[str],
) -> Committed:
    """Take one snapshot with every rank of ``comm``; returns the committed record on every
    rank (and the manifest on rank 0).

    ``states`` are this rank's already-called (or staged) state dicts; ``ddp`` names the
    app_state entries that were DistributedDataParallel modules (their tensors are replicated).
    """
    with LocalTake(repo, spec) as t:
        # 1. plan
        with phase(comm, "planning", "distributed take (planning)") as ph:
            local = classify(states, ddp, spec.replicated, t.opts)
            leaves = {k: leaf.desc for k, leaf in local.leaves.items()}
            t.guard.watch({k: d["dtype"] for k, d in leaves.items() if "dtype" in d})
            ph.send({"tree": blake3.blake3(canonical_json(local.apps)).hexdigest(), "leaves": leaves,
                     "layout": layout_digest(leaves)})
        descs = ph.received
        layout = plan(descs, t.opts)
        coalesce_replicated(layout.demoted, local, comm.rank)

        # 2. assign and hash
        with phase(comm, "hashing", "distributed take (hashing)") as ph:
            _cut_chunks(local, layout.assignment[comm.rank], t.opts)
            t.hash([c for _, _, c in local.chunks])
            lists: dict[str, list[Any]] = defaultdict(list)
            for key, (o, s), c in local.chunks:
                lists[key].append([list(o), list(s), c.id])
            ph.send({"chunks": lists, "bytes": sum({c.id: len(c.view) for _, _, c in local.chunks}.values()),
                     "health": t.guard.partials()})
        results = ph.received
        owners = _writers(results, descs, comm.world)

        # 3. write
        with phase(comm, "writing chunks", "distributed take (writing)") as ph:
            ph.send(_write_mine(t, local, owners, comm.rank))
        statuses = ph.received

        # 4. commit (rank 0); the others end their sessions only once it is done, so their
        # pins protect what they wrote or reused until the snapshot references it
        with phase(comm, "commit", "distributed take (commit)", root=0) as ph:
            if comm.rank == 0:
                manifest = _manifest(t, local, descs, list(layout.keys), results, statuses, comm.world)
                figures = {k: sum(s[k] for s in statuses) for k in ("new_bytes", "new_chunks", "reused_chunks")}
                record = t.commit(manifest, validate=True, figures=figures)  # every tensor's pieces must tile it
                ph.send(asdict(record))
        if comm.rank != 0:
            t.hand_over()
            return SnapshotRecord(**ph.received), None
        return record, manifest


def take_async(
    repo: Repository, app_state: Mapping[str, Any], spec: TakeSpec, pg: ProcessGroup | None
) -> Future[Committed]:
    """Stage this rank's state now; take it with every rank in the background.

    The group is opened now (opening waits for every member), and the state copied; the take
    then runs on one background thread per process (:func:`background`), so the ranks' takes
    run their collectives in call order.
    """
    comm = Comm(pg, spec.dist_timeout, purpose="async")
    ddp = ddp_apps(app_state)
    staged = stage(state_dicts(app_state))
    return background().submit(take, repo, staged, spec, comm, ddp)


_BACKGROUND: list[ThreadPoolExecutor] = []


def background() -> ThreadPoolExecutor:
    """The one thread that runs this process's async distributed takes, in call order.

    One thread keeps the order of collectives the same on every rank.
    """
    if not _BACKGROUND:
        _BACKGROUND.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckstore-dist-async"))
    return _BACKGROUND[0]


def _cut_chunks(local: Local, mine: Sequence[tuple[str, Box]], opts: TakeOptions) -> None:
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
        local.chunks.append((key, (po, ps), Chunk(key, byte_view(sub), t.element_size(), leaf.desc["dtype"] in GROUPED)))
    for key, leaf in local.leaves.items():
        if leaf.kind != LOCAL or "data" in leaf.desc:
            continue
        lt = leaf.tensor
        assert lt is not None
        view = byte_view(lt)
        grid = make_grid(tuple(lt.shape), lt.element_size(), opts.chunk_bytes)
        for offsets, sizes in grid.boxes():
            start, stop = grid.byte_range(offsets, sizes)
            local.chunks.append((key, (offsets, sizes), Chunk(key, view[start:stop], lt.element_size(), leaf.desc["dtype"] in GROUPED)))


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


def _write_mine(t: LocalTake, local: Local, owners: dict[str, int], rank: int) -> dict[str, int]:
    """Pin what the store has of the chunks this rank writes, write the rest; the figures."""
    t.store([c for _, _, c in local.chunks if owners.get(c.id) == rank], hashed=True)
    return {
        **t.stats.figures(),
        "written_raw_bytes": t.stats.written_raw_bytes,
        "hashed_bytes": sum(len(c.view) for _, _, c in local.chunks),
    }


def _manifest(
    t: LocalTake,
    local: Local,
    descs: list[dict[str, Any]],
    keys: list[str],
    results: list[dict[str, Any]],
    statuses: list[dict[str, Any]],
    world: int,
) -> Manifest:
    """Rank 0: the one manifest, built from every rank's pieces (and health figures)."""
    for res in results:
        t.guard.merge(res.get("health", ()))
    entries = {key: _entry(key, descs, results, t.opts) for key in keys}
    return t.manifest(local.apps, entries, world_size=world, ranks=statuses)


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
