"""Opening a snapshot for a distributed restore: each metadata object read once in the job.

1. **root**: rank 0 reads the manifest object and sends its bytes to every rank, which checks
   them against the snapshot id and parses them (a manifest stored whole is then known to
   every rank, read once; a DCP save's is re-keyed to the destination here).
2. **parts** (a manifest stored in parts, docs/FORMAT.md 7.7): each rank works out which parts
   hold what its destination needs (``engine/manifests.parts_for``: its DTensor shards'
   regions, its own per-rank values), then the nodes above them and the parts themselves are
   read like the chunks of the restore are: rank 0 plans one reader per object among the
   ranks needing it (``_readplan``), readers verify and send (``_exchange``). With
   ``replicated_read="each"`` every rank reads its own.
3. each rank's view (``format.parts.partial``), checked to cover its regions.

No rank lists anything: the root names every object by id, the index says where it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import objects
from ..engine.manifests import chunk_reader, parts_for, read_parts
from ..engine.restore.dcp_keys import dcp_overlay, is_dcp_manifest
from ..engine.restore.fetch import Fetcher
from ..engine.restore.jobs import Job
from ..engine.restore.reader import is_dtensor_dest
from ..engine.view import SnapshotView
from ..errors import CorruptionError
from ..format.grid import Box
from ..format.manifest import Manifest, TensorEntry
from ..format.parts import Level, Part, Root, parse_any, parse_node, partial
from ..format.tiling import uncovered
from ..format.tree import flatten, tree_refs
from ._exchange import Exchange
from ._progress import Progress
from ._readplan import Part as ReadPart
from ._readplan import Table, plan_reads, runs_of
from .comm import Comm, phase

KEY = "(manifest)"
"""What the exchange names a manifest object by, in messages."""


def open_manifest(
    comm: Comm,
    view: SnapshotView,
    app_state: Mapping[str, Any],
    strict: bool,
    shared: bool,
    prog: Progress,
    what: str,
) -> tuple[Manifest, dict[int, Part] | None]:
    """This rank's manifest of ``view`` and, for one stored in parts, the parts it read (see
    the module docstring); ``shared``: each object read by one rank and sent."""
    where = view.where
    with phase(comm, "open", what, root=0) as ph:
        raw = view.raw() if comm.rank == 0 else b""
        ph.send(len(raw))
    raw = comm.broadcast_bytes(raw, "open")
    with phase(comm, "open", what, collect="none"):
        if objects.chunk_id(raw) != view.record.manifest_id:
            raise CorruptionError(f"{where}: the bytes rank 0 sent do not match its id")
        doc = parse_any(raw, where)
        if isinstance(doc, Manifest):
            if is_dcp_manifest(doc):
                doc = dcp_overlay(doc, app_state, strict)
            wanted: set[int] = set()
            regions: dict[str, Box | None] = {}
        else:
            regions = _regions(doc, app_state)
            wanted = parts_for(doc, comm.rank, regions)
    if isinstance(doc, Manifest):
        return doc, None
    repo = view.repo
    if shared and comm.world > 1:
        with Fetcher(repo.objects, repo.index, where, repo.threads) as fetcher:
            parts, ids = _read_shared(comm, doc, wanted, fetcher, prog, what, where)
    else:
        with phase(comm, "open", what, collect="none"):
            read = chunk_reader(repo.objects, repo.index, where)
            parts, ids = read_parts(doc, wanted, read, where)
    with phase(comm, "open", what, collect="none"):
        manifest = partial(doc, parts, comm.rank, ids)
        _check_cover(manifest, regions, where, comm.rank)
    return manifest, parts


def _regions(root: Root, app_state: Mapping[str, Any]) -> dict[str, Box | None]:
    """What this rank's destination needs of each key stored in parts: a DTensor shard's box
    of the global tensor, or all of it (None)."""
    from ..format.boxes import local_box

    out: dict[str, Box | None] = {}
    for name, obj in app_state.items():
        if name not in root.apps:
            continue
        current = flatten(name, obj.state_dict(), lenient=True).leaves
        for key in tree_refs(root.apps[name]):
            if key in root.shells:
                dest = current.get(key)
                dtensor = isinstance(dest, torch.Tensor) and is_dtensor_dest(dest)
                out[key] = local_box(dest) if dtensor else None
    return out


def _check_cover(
    manifest: Manifest, regions: Mapping[str, Box | None], where: str, rank: int
) -> None:
    """The pieces read must cover each region this rank restores (each was verified
    against its id; a part that lacks a piece the layout puts there is damaged)."""
    for key, region in regions.items():
        entry = manifest.entries.get(key)
        if not isinstance(entry, TensorEntry) or entry.inline:
            continue
        offs, sizes = region if region is not None else ((0,) * len(entry.shape), entry.shape)
        gap = uncovered(offs, sizes, entry.chunks)
        if gap:
            raise CorruptionError(
                f"{where}: the parts read for rank {rank} leave {gap} elements of key {key!r} "
                "uncovered (a part lacks pieces its layout puts there); check the snapshot "
                "with `ckstore check`"
            )


def _read_shared(
    comm: Comm,
    root: Root,
    wanted: set[int],
    fetcher: Fetcher,
    prog: Progress,
    what: str,
    where: str,
) -> tuple[dict[int, Part], list[str]]:
    """The parts ``wanted`` and the nodes above them, each read once in the job: one round of
    the read plan and the exchange per level of the tree (the ranks agree when it ends)."""
    levels = [root.parts]
    ids: list[str] = []
    while comm.all_reduce_max([int(any(lv.span > 1 for lv in levels))], "open")[0]:
        above = {(lv, lv.child_of(p)) for lv in levels for p in wanted if _under(lv, p)}
        todo = sorted(above, key=lambda x: (x[0].first, x[1]))
        slots = {lv.child_parts(j)[0]: lv.children[j] for lv, j in todo}
        got = _read_once(comm, fetcher, slots, prog, what)
        levels = []
        for lv, j in todo:
            cid, _ = lv.children[j]
            first, count = lv.child_parts(j)
            levels.append(parse_node(got[cid], f"{where}, node {cid[:12]}", first, count, lv.span))
            ids.append(cid)
    named = {p: lv.children[p - lv.first] for lv in levels for p in wanted if _under(lv, p)}
    got = _read_once(comm, fetcher, named, prog, what)
    parts = {
        p: Part.from_json(got[cid], f"{where}, part {p}", p, root) for p, (cid, _) in named.items()
    }
    ids.extend(sorted({cid for cid, _ in named.values()}))
    return parts, ids


def _read_once(
    comm: Comm,
    fetcher: Fetcher,
    wanted: Mapping[int, tuple[str, int]],
    prog: Progress,
    what: str,
) -> dict[str, bytes]:
    """The objects ``wanted`` (slot -> id and size; a slot names one object alike on every
    rank), each read and verified by one rank needing it and sent to the others."""
    table = Table(
        {s: cid for s, (cid, _) in wanted.items()},
        {s: n for s, (_, n) in wanted.items()},
        {s: KEY for s in wanted},
        {cid: s for s, (cid, _) in wanted.items()},
    )
    bufs = {cid: bytearray(n) for cid, n in wanted.values()}
    jobs = [Job(KEY, cid, memoryview(buf)) for cid, buf in bufs.items()]
    with phase(comm, "open", what, collect="root") as ph:
        ph.send([[s, n] for s, (_, n) in sorted(wanted.items())])
    gathered = ph.received
    with phase(comm, "open", what, root=0) as ph:
        parts: list[Any] | None = None
        if comm.rank == 0:
            sizes = {int(s): int(n) for needs in gathered for s, n in needs}
            needs = [runs_of(int(s) for s, _ in g) for g in gathered]
            plan = plan_reads(needs, [0] * comm.world, sizes, atomic=False)
            parts = [p.to_json() for p in plan.parts]
            ph.send(plan.common())
    common = ph.received
    mine = ReadPart.from_json(comm.scatter_json(parts, "open"))
    x = Exchange(comm, fetcher, table, mine, common, jobs, prog, "open", held=False)
    with phase(comm, "open", what, collect="none"):
        x.run()
        if not x.stopped:
            fetcher.load(x.own_jobs())
    return {cid: bytes(buf) for cid, buf in bufs.items()}


def _under(level: Level, part: int) -> bool:
    return level.first <= part < level.first + level.count
