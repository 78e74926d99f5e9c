"""The distributed take: every rank writes its share of the chunks and its part of the
manifest; rank 0 commits once, over the parts' ids.

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
   (say, equal within a data-parallel group): those ranks share its chunks' writes. Meanwhile
   every rank fingerprints its whole copy of the replicated tensors, and the same all-reduce
   compares the copies (``_replicas``); where they differ, a second round names the ranks
   and regions, recorded in the snapshot's health (``on_divergence``). It fingerprints its
   DTensor shards that other ranks hold too (a replicating mesh dimension) alike; those are
   compared by the write phase's all-reduced sum (below).
3. write: look up (and pin) the chunks this rank writes, write the missing ones (packs
   durable, then indexed); then this rank's part of the manifest (``_parts``: its pieces, its
   differing per-rank values, its figures) as a chunk, and pin every chunk the part names to
   the take's staging session (rank 0's). -> rank 0 gets the part's id and size and the ids of
   the replicated pieces this rank wrote (40 bytes + 32 per replicated piece); every rank
   adds up, key by key, the entries' digests and sizes and the health figures (all-reduces of
   O(keys)), and the shards' fingerprints weighted to add up to zero where every group holding
   a box agrees (``_replicas.shard_vector``); where one does not, a second round names the
   ranks and pieces.

Every piece and every distinct per-rank value has one writer. Identical bytes that happen
to appear in different places (a zero block in two ranks' shards) are not searched for
across ranks: two ranks may both write such a chunk, the index keeps the first location,
and ``gc``'s repack reclaims the other copy.
4. commit (rank 0): store the nodes over the parts and the root (docs/FORMAT.md, 7.7: the
   manifest in parts; rank 0 never reads another rank's entries), commit it in one index
   transaction that also turns the staging session's pins into the snapshot's references.
   -> broadcast the record and the root, or the error. Other ranks end their sessions only
   now, so their pins protect what they wrote or reused until the snapshot references it.

Any failure raises :class:`DistributedError` on every rank, naming the failed ranks and their
causes; nothing is committed unless every rank succeeded. A rank whose commit phase fails asks
the index what the commit did (``_outcome``): a snapshot committed without word reaching it
(rank 0 died right after) is returned, not reported as failed.
"""

from __future__ import annotations

import base64
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import blake3

from ..engine.manifests import open_partial
from ..engine.repository import Repository
from ..engine.repository import describe as describe_record
from ..engine.take.guard import remember
from ..engine.take.local import LocalTake
from ..engine.take.packing import Chunk, TakeOptions
from ..engine.take.spec import TakeSpec
from ..errors import DistributedError
from ..format.dtypes import GROUPED, itemsize
from ..format.grid import Box, make_grid
from ..format.health import Replicas
from ..format.layout import Layout
from ..format.manifest import (
    ChunkRef,
    Entry,
    Manifest,
    TensorEntry,
    ValueEntry,
    canonical_json,
    entry_digest,
)
from ..format.parts import Root, build_tree, partial
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
)
from ._outcome import settled
from ._parts import (
    Record,
    layout_vector,
    located,
    named_chunks,
    part_of,
    replicated_ids,
    root_of,
    session_of,
    session_vector,
    sums,
)
from ._plan import (
    Agreed,
    agree,
    assignment,
    describe,
    header,
    in_step,
    ints62,
    key_vector,
    same,
)
from ._progress import progress
from ._replicas import compare_shards, differing, fingerprints, locate, merged, shard_vector, vector
from .comm import Comm, phase

if TYPE_CHECKING:
    pass

log = logging.getLogger("ckstore")
Committed = tuple[SnapshotRecord, "Manifest | None"]
WHAT = "distributed take"


def take(
    repo: Repository,
    states: Mapping[str, Any],
    spec: TakeSpec,
    comm: Comm,
    ddp: Mapping[str, frozenset[str]],
) -> Committed:
    """Take one snapshot with every rank of ``comm``; returns the committed record on every
    rank (the manifest, stored in parts, is read back on first use).

    ``states`` are this rank's already-called (or staged) state dicts; ``ddp`` names the
    app_state entries that were DistributedDataParallel modules (their tensors are replicated),
    each with its buffers' keys (replicated, but not compared between ranks: ``ddp_apps``).
    """
    with LocalTake(repo, spec) as t, progress(comm.group, WHAT) as prog:
        # 1. plan
        local, agreed = _plan(comm, states, ddp, spec, t.opts)
        mine = assignment(local, agreed, comm.world, comm.rank, t.opts)
        _open_parent_partly(t, local, comm)
        t.guard.watch(
            {k: leaf.desc["dtype"] for k, leaf in local.leaves.items() if "dtype" in leaf.desc}
        )

        # 2. hash; which per-rank leaves are the same everywhere; the layouts; rank 0's staging
        with phase(comm, "hash", f"{WHAT} (hash)", collect="none") as ph:
            staging = t.staging() if comm.rank == 0 else None
            _cut_chunks(local, mine, t.opts)
            with ThreadPoolExecutor(1, thread_name_prefix="ckstore-replicas") as pool:
                compared = agreed.replicated.difference(*ddp.values())
                copies = pool.submit(fingerprints, local, compared, t.opts, repo.threads)
                t.hash([c for _, _, c in local.chunks])
                fp = copies.result()
            prog.add("hashed", sum(len(c.view) for _, _, c in local.chunks))
            own = _own_entries(local, t.opts)
            digests = {k: entry_digest(e) for k, e in own.items()}
            equality = [x for d in digests.values() for a in ints62(d.encode()) for x in (a, -a)]
            replicas = vector(fp)
            sessions = session_vector(staging, t.session if comm.rank == 0 else None)
            ph.send_max(equality + replicas + layout_vector(local) + sessions)
        equal = {
            k for n, k in enumerate(own) if same(ph.maxed, 4 * n) and same(ph.maxed, 4 * n + 2)
        }
        apart = differing(fp, ph.maxed, len(equality))
        found = locate(comm, fp, apart) if apart else Replicas(len(fp.keys)) if fp.keys else None
        layouts = located(local, ph.maxed[len(equality) + len(replicas) : -8])
        staged, owner = session_of(ph.maxed[-8:-4]), session_of(ph.maxed[-4:])
        groups = _groups(comm, [(k, d) for k, d in digests.items() if k not in equal])

        # 3. write this rank's chunks, then its part of the manifest (a chunk), whose chunks it
        # pins to the staging session
        with phase(comm, "write", f"{WHAT} (write)", collect="none"):
            prog.watch("written", lambda: t.stats.written_raw_bytes)
            t.store(_writes(local, own, equal, groups, comm), hashed=True)
            totals = t.stats.figures()
            part = part_of(comm.rank, local, own, equal, _figures(t, local))
            raw = part.to_json()
            (part_id,) = t.store_objects([raw], "manifest part")
            t.pin_staged(staged, named_chunks(part) | {part_id}, f"the part of rank {comm.rank}")
            record = Record(part_id, len(raw), replicated_ids(local, mine))
        gathered = comm.gather_bytes(record.to_bytes(), "write")
        added = sums(t.guard, local, own, equal, part, comm.rank, comm.world, totals, t.opts)
        ints = comm.all_reduce_sum(added[0] + shard_vector(fp, local, comm.rank), "write")
        summed = (
            ints[: len(added[0])],
            comm.all_reduce_fsum(added[1], "write"),
            comm.all_reduce_max(added[2], "write"),
        )
        shards = compare_shards(comm, fp, local, ints[len(added[0]) :], t.opts)
        if comm.rank == 0:  # applied with the other findings when the root is built
            t.guard.replicas = merged(found, shards)

        # 4. commit (rank 0): the root over every rank's part; the others end their sessions
        # only once it is done, so their pins protect what they wrote until it is referenced.
        # If word of it is lost (rank 0 dies right after), the index tells what happened.
        committed: dict[str, Any] | None = None
        try:
            with phase(comm, "commit", f"{WHAT} (commit)", root=0) as ph:
                if comm.rank == 0:
                    assert gathered is not None
                    records = [Record.from_bytes(x, r) for r, x in enumerate(gathered)]
                    committed = _commit(t, local, own, equal, layouts, agreed, records, summed)
                    ph.send(committed)
        except DistributedError as exc:
            if committed is not None:  # rank 0 committed; another rank was lost meanwhile
                ours = SnapshotRecord(**committed["record"])
                log.warning("distributed take: %s is committed, though: %s", ours.id, exc)
                return ours, None
            landed = settled(t.repo, exc, staged, owner, part_id, t.spec.run)
            if landed is None:
                raise
            if comm.rank == 0:  # its commit went through, but its answer was lost
                t.adopt(landed)
            else:
                t.hand_over()
            return landed, None
        done = SnapshotRecord(**ph.received["record"])
        if comm.rank != 0:
            t.hand_over()
        root = Root.from_json(ph.received["root"].encode(), f"manifest of {done.id[:12]}")
        view = partial(root, {comm.rank: part}, comm.rank, ())
        remember(done.manifest_id, view, t.guard.view_key)  # what the run's next take compares
        return done, None


def _commit(
    t: LocalTake,
    local: Local,
    own: dict[str, Entry],
    equal: set[str],
    layouts: dict[str, Layout],
    agreed: Agreed,
    records: list[Record],
    summed: tuple[list[int], list[float], list[int]],
) -> dict[str, Any]:
    """Rank 0: store the nodes over the parts, build and store the root, commit."""
    level, nodes = build_tree([(r.part, r.size) for r in records])
    node_ids = t.store_objects(nodes, "manifest node", defer=True)
    world = len(records)
    c = root_of(
        t.guard,
        local,
        own,
        equal,
        layouts,
        agreed,
        records,
        (level, node_ids),
        summed,
        lambda keys, found: t.header(dict.fromkeys(keys), found, world_size=world),
        t.opts,
    )
    raw = c.root.to_json()
    record = t.commit_root(
        raw,
        c.root.snapshot or {},
        c.entries,
        c.chunk_ids,
        logical_bytes=c.logical_bytes,
        figures=c.figures,
    )
    return {"record": asdict(record), "root": raw.decode()}


def _figures(t: LocalTake, local: Local) -> dict[str, int]:
    """This rank's write figures, as its part records them."""
    return {
        **t.stats.figures(),
        "written_raw_bytes": t.stats.written_raw_bytes,
        "hashed_bytes": sum(len(c.view) for _, _, c in local.chunks),
    }


def _open_parent_partly(t: LocalTake, local: Local, comm: Comm) -> None:
    """This rank reads of the run's latest snapshot only the regions it holds now."""
    regions = {k: leaf.box if leaf.kind == DTENSOR else None for k, leaf in local.leaves.items()}
    repo = t.repo

    def opener(rec: SnapshotRecord) -> Manifest:
        raw = repo.objects.get_blob("manifests", rec.manifest_id)
        where = f"manifest of {describe_record(rec)}"
        return open_partial(repo.objects, repo.index, raw, where, comm.rank, regions)

    t.guard.opener = opener
    t.guard.view_key = f"#{comm.rank}/{comm.world}"


def _plan(
    comm: Comm,
    states: Mapping[str, Any],
    ddp: Mapping[str, frozenset[str]],
    spec: TakeSpec,
    opts: TakeOptions,
) -> tuple[Local, Agreed]:
    """Phase 1: describe this rank's leaves; agree on the layout and the replicated keys."""
    which, number = _which(spec, comm), comm.number
    described: tuple[Local, str] | None = None
    while True:
        with phase(comm, "plan", f"{WHAT} (plan)", collect="none") as ph:
            if described is None:
                local = classify(states, ddp, spec.replicated, opts, comm.members)
                described = local, blake3.blake3(canonical_json(local.apps)).hexdigest()
            local, tree = described
            ph.send_max(
                header(local, tree)
                + [len(local.leaves), -len(local.leaves), number, -number, which, -which]
            )
        if in_step(ph.maxed, number, spec.run, spec.step):  # every rank decides alike
            break
    if not (same(ph.maxed, 0) and same(ph.maxed, 2) and same(ph.maxed, 4)):
        _refuse_mismatch(comm, local, tree)  # every rank saw the same maxima: all go here
    agreed = agree(list(local.leaves), comm.all_reduce_max(key_vector(local), "plan"))
    coalesce_replicated(agreed.demoted, local, comm.rank)
    return local, agreed


def _which(spec: TakeSpec, comm: Comm) -> int:
    """A digest of which take this is: its run, step and name, and its number among this
    process's async takes over the group (``Comm.count``), equal on every rank of one take."""
    return ints62(canonical_json([spec.run, spec.step, spec.name, comm.number]))[0]


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
