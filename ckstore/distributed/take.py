"""The distributed take: every rank writes its share of the chunks; rank 0 commits once.

Phases, each closed by one bounded collective so that a failure anywhere stops every rank at
the same point (no rank commits or waits on a rank that gave up). No phase sends any rank's
metadata to every rank: what every rank must agree on travels as small all-reduced vectors,
what only the commit needs goes to rank 0 alone.

1. plan: flatten this rank's state and describe every leaf (DTensor shard box and the ranks
   holding the same box, replicated tensor, per-rank tensor or plain value); agree on the
   layout and on which keys are replicated everywhere (``_plan``: two all-reduces of O(keys)
   ints); give this rank its pieces (its DTensor blocks cut by its box, spread over the
   ranks holding that box; its share of the replicated tensors' blocks), cached across
   takes of the same layout.
2. hash: hash the assigned pieces and every per-rank tensor; agree, key by key, which
   per-rank leaves are the same on every rank (an all-reduce of entry digests): those are
   stored once, and each rank writes a share of their chunks by position. For the others,
   rank 0 alone gathers their digests and tells each rank which ranks hold the same value
   (say, equal within a data-parallel group): those ranks share its chunks' writes.
3. write: look up (and pin) the chunks this rank writes, write the missing ones (packs
   durable, then indexed). -> this rank's pieces, differing values and figures to rank 0.

Every piece and every distinct per-rank value has one writer. Identical bytes that happen
to appear in different places (a zero block in two ranks' shards) are not searched for
across ranks: two ranks may both write such a chunk, the index keeps the first location,
and ``gc``'s repack reclaims the other copy.
4. commit (rank 0): build the one manifest, store it, commit it in one index transaction.
   -> broadcast the record or the error. Other ranks end their sessions only now, so their
   pins protect what they wrote or reused until the snapshot references it.

Any failure raises :class:`DistributedError` on every rank, naming the failed ranks and their
causes; nothing is committed unless every rank succeeded.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import blake3

from ..engine.repository import Repository
from ..engine.take.local import LocalTake
from ..engine.take.packing import Chunk, TakeOptions
from ..engine.take.plan import state_dicts
from ..engine.take.spec import TakeSpec
from ..engine.take.staging import stage
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
    entry_from_dict,
)
from ..format.tensors import byte_view
from ..index import SnapshotRecord
from ._classify import (
    DTENSOR,
    LOCAL,
    VALUE,
    Local,
    check_same_structure,
    classify,
    coalesce_replicated,
    ddp_apps,
)
from ._plan import Agreed, agree, assignment, describe, header, ints62, key_vector, same
from ._progress import progress
from .comm import Comm, phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Committed = tuple[SnapshotRecord, "Manifest | None"]
WHAT = "distributed take"


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
    with LocalTake(repo, spec) as t, progress(comm.group, WHAT) as prog:
        # 1. plan
        local, agreed = _plan(comm, states, ddp, spec, t.opts)
        mine = assignment(local, agreed, comm.world, comm.rank, t.opts)
        t.guard.watch(
            {k: leaf.desc["dtype"] for k, leaf in local.leaves.items() if "dtype" in leaf.desc}
        )

        # 2. hash; which per-rank leaves are the same everywhere
        with phase(comm, "hash", f"{WHAT} (hash)", collect="none") as ph:
            _cut_chunks(local, mine, t.opts)
            t.hash([c for _, _, c in local.chunks])
            prog.add("hashed", sum(len(c.view) for _, _, c in local.chunks))
            own = _own_entries(local, t.opts)
            digests = {k: entry_digest(e) for k, e in own.items()}
            ph.send_max([x for d in digests.values() for a in ints62(d.encode()) for x in (a, -a)])
        equal = {
            k for n, k in enumerate(own) if same(ph.maxed, 4 * n) and same(ph.maxed, 4 * n + 2)
        }
        groups = _groups(comm, [(k, d) for k, d in digests.items() if k not in equal])

        # 3. write this rank's chunks
        with phase(comm, "write", f"{WHAT} (write)", collect="root") as ph:
            prog.watch("written", lambda: t.stats.written_raw_bytes)
            t.store(_writes(local, own, equal, groups, comm), hashed=True)
            ph.send(_report(t, local, own, equal))
        reports = ph.received

        # 4. commit (rank 0); the others end their sessions only once it is done, so their
        # pins protect what they wrote or reused until the snapshot references it
        with phase(comm, "commit", f"{WHAT} (commit)", root=0) as ph:
            if comm.rank == 0:
                manifest = _manifest(t, local, own, equal, reports, comm.world)
                figures = {
                    k: sum(r["figures"][k] for r in reports)
                    for k in ("new_bytes", "new_chunks", "reused_chunks")
                }
                record = t.commit(
                    manifest, validate=True, figures=figures
                )  # every tensor's pieces must tile it
                ph.send(asdict(record))
        if comm.rank != 0:
            t.hand_over()
            return SnapshotRecord(**ph.received), None
        return record, manifest


def _plan(
    comm: Comm, states: Mapping[str, Any], ddp: set[str], spec: TakeSpec, opts: TakeOptions
) -> tuple[Local, Agreed]:
    """Phase 1: describe this rank's leaves; agree on the layout and the replicated keys."""
    with phase(comm, "plan", f"{WHAT} (plan)", collect="none") as ph:
        local = classify(states, ddp, spec.replicated, opts, comm.members)
        tree = blake3.blake3(canonical_json(local.apps)).hexdigest()
        ph.send_max(header(local, tree) + [len(local.leaves), -len(local.leaves)])
    if not (same(ph.maxed, 0) and same(ph.maxed, 2) and same(ph.maxed, 4)):
        _refuse_mismatch(comm, local, tree)  # every rank saw the same maxima: all go here
    agreed = agree(list(local.leaves), comm.all_reduce_max(key_vector(local), "plan"))
    coalesce_replicated(agreed.demoted, local, comm.rank)
    return local, agreed


def _refuse_mismatch(comm: Comm, local: Local, tree: str) -> None:
    """The ranks' layouts differ: gather them (this error path only) and say how."""
    descs = comm.all_gather_json({"tree": tree, **describe(local)}, "plan")
    check_same_structure(descs)
    raise DistributedError(
        f"{WHAT}: the ranks' states differ in their DTensor layouts (dtype or global shape)"
    )


def _own_entries(local: Local, opts: TakeOptions) -> dict[str, Entry]:
    """This rank's entry of every per-rank leaf (plain values and per-rank tensors)."""
    chunks: dict[str, list[list[Any]]] = defaultdict(list)
    for key, (o, s), c in local.chunks:
        if local.leaves[key].kind == LOCAL:
            chunks[key].append(ChunkRef(o, s, c.id, c.check or None).to_list())
    return {
        k: _own_entry(k, x.desc, chunks.get(k, []), opts)
        for k, x in local.leaves.items()
        if x.kind in (LOCAL, VALUE)
    }


def _groups(comm: Comm, differing: list[tuple[str, str]]) -> dict[str, list[int]]:
    """For per-rank leaves not equal everywhere, the ranks holding the same value as this one
    (only where more than one does). Rank 0 alone gathers the digests; each rank gets its own
    groups back. Skipped (no collective) when every per-rank leaf is equal everywhere, which
    every rank knows alike."""
    if not differing or comm.world == 1:
        return {}
    gathered = comm.gather_json([d for _, d in differing], "hash")
    parts: list[dict[str, list[int]]] | None = None
    if gathered is not None:
        parts = [{} for _ in gathered]
        for n in range(len(differing)):
            by: dict[str, list[int]] = defaultdict(list)
            for r, ds in enumerate(gathered):
                by[ds[n]].append(r)
            for members in by.values():
                if len(members) > 1:
                    for r in members:
                        parts[r][str(n)] = members
    mine = comm.scatter_json(parts, "hash")
    return {differing[int(n)][0]: [int(r) for r in members] for n, members in mine.items()}


def _writes(
    local: Local, own: dict[str, Entry], equal: set[str], groups: dict[str, list[int]], comm: Comm
) -> list[Chunk]:
    """The chunks this rank writes: its assigned pieces; its per-rank tensors, or its share of
    those held alike by several ranks: chunk ``j`` of a value equal everywhere goes to rank
    ``position % world``, of one equal within a group to ``group[j % len(group)]``."""
    share: set[tuple[str, str]] = set()
    at = 0
    for k, e in own.items():
        if not isinstance(e, TensorEntry) or (k not in equal and k not in groups):
            continue
        for j, c in enumerate(e.chunks):
            if (
                k in equal
                and at % comm.world == comm.rank
                or k in groups
                and groups[k][j % len(groups[k])] == comm.rank
            ):
                share.add((k, c.id))
            at += k in equal
    return [
        c
        for key, _, c in local.chunks
        if local.leaves[key].kind != LOCAL
        or (key not in equal and key not in groups)
        or (key, c.id) in share
    ]


def _report(t: LocalTake, local: Local, own: dict[str, Entry], equal: set[str]) -> dict[str, Any]:
    """What rank 0 needs from this rank to build the manifest."""
    pieces: dict[str, list[Any]] = defaultdict(list)
    for key, (o, s), c in local.chunks:
        if local.leaves[key].kind != LOCAL:
            pieces[key].append(ChunkRef(o, s, c.id, c.check or None).to_list())
    return {
        "figures": {
            **t.stats.figures(),
            "written_raw_bytes": t.stats.written_raw_bytes,
            "hashed_bytes": sum(len(c.view) for _, _, c in local.chunks),
        },
        "pieces": pieces,
        "own": {k: e.to_dict() for k, e in own.items() if k not in equal},
        "health": t.guard.partials(),
    }


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
        _BACKGROUND.append(
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckstore-dist-async")
        )
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
        local.chunks.append(
            (
                key,
                (po, ps),
                Chunk(key, byte_view(sub), t.element_size(), leaf.desc["dtype"] in GROUPED),
            )
        )
    for key, leaf in local.leaves.items():
        if leaf.kind != LOCAL or "data" in leaf.desc:
            continue
        lt = leaf.tensor
        assert lt is not None
        view = byte_view(lt)
        grid = make_grid(tuple(lt.shape), lt.element_size(), opts.chunk_bytes)
        for offsets, sizes in grid.boxes():
            start, stop = grid.byte_range(offsets, sizes)
            local.chunks.append(
                (
                    key,
                    (offsets, sizes),
                    Chunk(key, view[start:stop], lt.element_size(), leaf.desc["dtype"] in GROUPED),
                )
            )


def _manifest(
    t: LocalTake,
    local: Local,
    own: dict[str, Entry],
    equal: set[str],
    reports: list[dict[str, Any]],
    world: int,
) -> Manifest:
    """Rank 0: the one manifest, from its own leaves and every rank's report (and health figures)."""
    for rep in reports:
        t.guard.merge(rep.get("health", ()))
    entries: dict[str, Entry] = {}
    for key, leaf in local.leaves.items():
        if key in own:
            entries[key] = (
                own[key]
                if key in equal
                else PerRankEntry(
                    tuple(
                        _per_rank(
                            own[key] if r == 0 else entry_from_dict(rep["own"][key], key), key
                        )
                        for r, rep in enumerate(reports)
                    )
                )
            )
        else:
            entries[key] = _shared_entry(key, leaf.desc, reports, t.opts)
    return t.manifest(local.apps, entries, world_size=world, ranks=[r["figures"] for r in reports])


def _per_rank(entry: Entry, key: str) -> TensorEntry | ValueEntry:
    if not isinstance(entry, (TensorEntry, ValueEntry)):
        raise DistributedError(f"{WHAT}: rank report for key {key!r} is not a tensor or a value")
    return entry


def _shared_entry(
    key: str, x: dict[str, Any], reports: list[dict[str, Any]], opts: TakeOptions
) -> TensorEntry:
    """A DTensor or replicated tensor: rank 0's description, every rank's pieces."""
    shape = tuple(x["shape"])
    if "data" in x:  # a small replicated tensor, inline from rank 0's leaf
        return TensorEntry(
            x["dtype"],
            shape,
            data=base64.b64decode(x["data"]),
            container=x["container"],
            device=x["device"],
        )
    refs = sorted(
        (_ref(piece) for rep in reports for piece in rep["pieces"].get(key, ())),
        key=lambda c: c.offsets,
    )
    block = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes).block
    return TensorEntry(
        x["dtype"], shape, tuple(refs), block, container=x["container"], device=x["device"]
    )


def _own_entry(
    key: str, x: dict[str, Any], chunks: Sequence[Sequence[Any]], opts: TakeOptions
) -> TensorEntry | ValueEntry:
    if x["t"] == VALUE:
        return ValueEntry(x["value"])
    shape = tuple(x["shape"])
    if "data" in x:
        return TensorEntry(
            x["dtype"],
            shape,
            data=base64.b64decode(x["data"]),
            container=x["container"],
            device=x["device"],
        )
    refs = tuple(_ref(piece) for piece in chunks)
    block = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes).block
    return TensorEntry(x["dtype"], shape, refs, block, container=x["container"], device=x["device"])


def _ref(piece: Sequence[Any]) -> ChunkRef:
    """A chunk ref from ``[offsets, sizes, id(, check)]`` as a rank reported it (the manifest
    built from it is validated before it is stored)."""
    o, s, cid = piece[:3]
    return ChunkRef(tuple(o), tuple(s), cid, piece[3] if len(piece) > 3 else None)
