"""Replicas that disagree: a distributed take compares every rank's copy of its replicated tensors.

A replicated tensor (a DDP module's, or one a ``replicated=`` glob names on every rank) is
stored once: each of its grid blocks is hashed and written by one rank
(``_plan.replicated_share``). Every rank still holds a whole copy, and the copies should be the
same bytes; if one is not (a bit flipped in one host's memory, a rank that skipped an update),
the snapshot would silently hold whichever blocks its writers held. So every rank fingerprints
its whole copy, block by block on the take's grid, and the ranks compare. Only fingerprints
travel, and only the first round runs when the copies agree:

1. Every rank computes a 62-bit XXH3 of each block of each replicated tensor, and of each
   tensor a fingerprint of its blocks' (:func:`fingerprints`, on the take's number of threads:
   XXH3 releases the GIL), while the take hashes its chunks. The pair ``[f, -f]`` per tensor rides in the hash phase's all-reduce
   (:func:`vector`): a tensor is alike on every rank iff the maximum of ``f`` is minus the
   maximum of ``-f`` (:func:`differing`). O(tensors) integers per rank, whatever the world size.
2. Only when some tensor differs (every rank sees it alike): for at most :data:`MAX_KEYS` of
   them, one all-reduce of ``[f, -f]`` per block finds the regions where any copy differs
   (O(blocks), flat in world size), and rank 0 alone gathers each rank's tensor fingerprints
   (O(world x MAX_KEYS) integers) to name the ranks whose copy is not the majority's
   (:func:`locate`).

A rank's copy is fingerprinted, not its BLAKE3 chunk ids: each block is hashed by its writer
only, so the ids a take computes anyway cannot show another rank's copy; XXH3 reads a copy at
memory speed (about a tenth of BLAKE3's cost, docs/RELIABILITY.md, I3).

What counts as replicated is what the take stores once: DDP modules and ``replicated=`` globs,
and a DTensor's shard where several ranks hold the same box (a ``Replicate`` mesh dimension, as
in HSDP). Those shards are fingerprinted piece by piece in the same pass and compared within
each group of holders by the write phase's all-reduced sum (:func:`shard_vector`: the lowest
holder adds ``(n - 1) * f``, each other holder ``-f``, so only a group that disagrees makes
it nonzero); a nonzero sum starts a second round on rank 0 (:func:`locate_shards`).
A plain per-rank value (an RNG state, a rank's own buffer, a sharded optimizer's state) may
differ between ranks by design; it is kept per rank and never compared.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from ..engine.take.packing import TakeOptions
from ..format.boxes import pieces
from ..format.dtypes import itemsize
from ..format.grid import Box, make_grid
from ..format.health import MAX_REGIONS, Divergence, Replicas
from ..format.tensors import byte_view
from ._classify import DTENSOR, Leaf, Local
from ._plan import same
from .comm import Comm

MAX_KEYS = 16
"""Differing tensors located block by block and rank by rank (the others are counted)."""

_HALF = (1 << 31) - 1


@dataclass
class Fingerprints:
    """This rank's fingerprints of its replicated tensors (keys in leaf order, the same order
    on every rank once the plan agreed).

    Attributes:
        keys: the replicated tensors compared.
        blocks: key -> (region, 62-bit fingerprint) of each grid block, in grid order; for a
            DTensor, of each grid block cut by this rank's box (its pieces), in global
            coordinates.
        whole: key -> 62-bit fingerprint of its blocks' fingerprints (for a DTensor, of its
            box's offsets and sizes and of that).
        shards: the DTensors whose shard on this rank other ranks hold too (a replicating mesh
            dimension: HSDP, a ``Replicate`` placement), in leaf order.
        holders: DTensor key -> the ranks holding this rank's box, this one included, sorted.
    """

    keys: list[str] = field(default_factory=list)
    blocks: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)


def fingerprints(
    local: Local, replicated: Iterable[str], opts: TakeOptions, threads: int = 1
) -> Fingerprints:
    """This rank's fingerprints of the replicated tensors (every block of its whole copy) and of
    its DTensor shards that other ranks hold too (every piece of its box), on ``threads``
    threads."""
    out = Fingerprints()
    chosen = set(replicated)
    views: list[memoryview] = []
    order: list[str] = []
    for key, leaf in local.leaves.items():
        if leaf.kind == DTENSOR and len(leaf.replicas) > 1 and leaf.tensor is not None:
            views += _shard_views(out, key, leaf, opts)
            order.append(key)
            continue
        if key not in chosen or leaf.tensor is None:
            continue
        order.append(key)
        x = leaf.desc
        shape = tuple(x["shape"])
        view = byte_view(leaf.tensor)
        grid = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes)
        boxes = list(grid.boxes()) if "data" not in x else [((0,) * len(shape), shape)]
        out.keys.append(key)
        out.blocks[key] = [(box, 0) for box in boxes]
        for box in boxes:
            start, stop = grid.byte_range(*box) if "data" not in x else (0, len(view))
            views.append(view[start:stop])
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckstore-replicas") as pool:
        found = iter(pool.map(_xxh62, views, chunksize=max(1, len(views) // (8 * threads))))
    for key in order:  # the order of the views
        out.blocks[key] = [(box, next(found)) for box, _ in out.blocks[key]]
        out.whole[key] = _combine(f for _, f in out.blocks[key])
    for key in out.shards:  # where the box lies, too: shards swapped between groups must not
        where = local.leaves[key].box  # cancel out in shard_vector's sum
        assert where is not None
        out.whole[key] = _combine([*where[0], *where[1], out.whole[key]])
    return out


def _shard_views(out: Fingerprints, key: str, leaf: Leaf, opts: TakeOptions) -> list[memoryview]:
    """Record ``key``'s shard in ``out`` (its pieces in global coordinates, its holders) and
    return a byte view of each piece of this rank's copy, in the same order."""
    assert leaf.tensor is not None and leaf.box is not None
    x, t, (base, _) = leaf.desc, leaf.tensor, leaf.box
    grid = make_grid(tuple(x["shape"]), itemsize(x["dtype"]), opts.chunk_bytes)
    found = list(pieces(grid, leaf.box))
    out.shards.append(key)
    out.holders[key] = tuple(sorted(leaf.replicas))
    out.blocks[key] = [(piece, 0) for piece in found]
    return [
        byte_view(t[tuple(slice(o - b, o - b + n) for o, b, n in zip(po, base, ps))])
        for po, ps in found
    ]


def _xxh62(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view) >> 2


def _combine(values: Iterable[int]) -> int:
    data = b"".join(struct.pack("<Q", v) for v in values)
    return xxhash.xxh3_64_intdigest(data) >> 2


def vector(fp: Fingerprints) -> list[int]:
    """``[f, -f]`` per replicated tensor, for the hash phase's all-reduce."""
    return [y for k in fp.keys for y in (fp.whole[k], -fp.whole[k])]


def differing(fp: Fingerprints, maxed: list[int], at: int) -> list[str]:
    """The replicated tensors whose copies are not alike on every rank, from the all-reduced
    :func:`vector` found at ``maxed[at:]`` (the same on every rank)."""
    return [k for n, k in enumerate(fp.keys) if not same(maxed, at + 2 * n)]


def shard_vector(fp: Fingerprints, local: Local, rank: int) -> list[int]:
    """Two ints per DTensor key (in leaf order, the same on every rank), for the write phase's
    all-reduced sum: zero on every rank iff every group of ranks holding the same box holds
    the same bytes (but for a chance of about 2**-62).

    Within each group the lowest rank adds ``(n - 1) * f`` and each other holder ``-f`` (``f``
    its shard's fingerprint, split into two 31-bit halves, ``n`` the group's size), so a group
    whose copies agree adds 0; a rank holding its box alone adds 0. ``f`` covers where the box
    lies as well as its bytes, so copies that differ in one group never cancel those of another
    by construction (two groups' shards swapped would otherwise add up to zero exactly). Flat:
    O(keys) per rank, whatever the world size or the number of groups."""
    out: list[int] = []
    for key, leaf in local.leaves.items():
        if leaf.kind != DTENSOR:
            continue
        holders = fp.holders.get(key, ())
        if len(holders) < 2:
            out += [0, 0]
            continue
        f = fp.whole[key]
        weight = len(holders) - 1 if rank == holders[0] else -1
        out += [weight * (f & _HALF), weight * (f >> 31)]
    return out


def compare_shards(
    comm: Comm, fp: Fingerprints, local: Local, summed: list[int], opts: TakeOptions
) -> Replicas | None:
    """What comparing the DTensor shards found, from the all-reduced sum of every rank's
    :func:`shard_vector` (``summed``, the same on every rank; a collective every rank calls
    alike): on rank 0, the finding (None where no shard is held by several ranks); None
    elsewhere. Only when some group disagrees does a second round run (:func:`locate_shards`)."""
    keys = [k for k, leaf in local.leaves.items() if leaf.kind == DTENSOR]
    apart = [k for n, k in enumerate(keys) if summed[2 * n] or summed[2 * n + 1]]
    if apart:
        return locate_shards(comm, fp, local, apart, opts)
    return Replicas(len(fp.shards)) if fp.shards and comm.rank == 0 else None


def locate_shards(
    comm: Comm, fp: Fingerprints, local: Local, keys: list[str], opts: TakeOptions
) -> Replicas | None:
    """The second round for DTensor shards (only when ``keys`` differ; a collective every rank
    calls alike): rank 0 gathers, for at most :data:`MAX_KEYS` of them, each rank's holders, box
    and piece fingerprints, and names per key the ranks whose copy is not their group's
    majority and the pieces where any copy differs. Returns the finding on rank 0, None
    elsewhere."""
    examined = keys[:MAX_KEYS]
    mine = [
        [list(fp.holders[k]), local.leaves[k].box, [f for _, f in fp.blocks[k]]]
        if k in fp.holders
        else None
        for k in examined
    ]
    gathered = comm.gather_json(mine, "write")
    if gathered is None:
        return None
    diverged: dict[str, Divergence] = {}
    for n, key in enumerate(examined):
        groups: dict[tuple[int, ...], dict[int, list[int]]] = {}
        boxes: dict[tuple[int, ...], Box] = {}
        for rank, per_rank in enumerate(gathered):
            if per_rank[n] is not None:
                holders, (offsets, sizes), prints = per_rank[n]
                groups.setdefault(tuple(holders), {})[rank] = [int(f) for f in prints]
                boxes[tuple(holders)] = (tuple(offsets), tuple(sizes))
        x = local.leaves[key].desc
        grid = make_grid(tuple(x["shape"]), itemsize(x["dtype"]), opts.chunk_bytes)
        ranks: set[int] = set()
        regions: list[Box] = []
        for group, members in sorted(groups.items()):
            ranks.update(_minority_of({r: _combine(p) for r, p in members.items()}))
            copies = list(members.values())
            regions += [
                piece
                for i, piece in enumerate(pieces(grid, boxes[group]))
                if len({p[i] if i < len(p) else None for p in copies}) > 1
            ]
        regions.sort()
        diverged[key] = Divergence(tuple(sorted(ranks)), tuple(regions[:MAX_REGIONS]), len(regions))
    for key in keys[MAX_KEYS:]:  # counted and named, not located
        diverged[key] = Divergence(())
    return Replicas(len(fp.shards), diverged)


def merged(first: Replicas | None, second: Replicas | None) -> Replicas | None:
    """Two findings as one (tensors compared added up, diverged keys together)."""
    if first is None or second is None:
        return first or second
    return Replicas(first.checked + second.checked, {**first.diverged, **second.diverged})


def locate(comm: Comm, fp: Fingerprints, keys: list[str]) -> Replicas | None:
    """The second round (only when ``keys`` differ; a collective every rank calls alike): where
    and on which ranks the copies differ. Returns the finding on rank 0, None elsewhere."""
    examined = keys[:MAX_KEYS]
    maxed = comm.all_reduce_max(
        [y for k in examined for _, f in fp.blocks[k] for y in (f, -f)], "hash"
    )
    gathered = comm.gather_json([fp.whole[k] for k in examined], "hash")
    if gathered is None:
        return None
    diverged: dict[str, Divergence] = {}
    at = 0
    for n, key in enumerate(examined):
        regions = []
        for box, _ in fp.blocks[key]:
            if not same(maxed, at):
                regions.append(box)
            at += 2
        ranks = _minority([int(per_rank[n]) for per_rank in gathered])
        diverged[key] = Divergence(tuple(ranks), tuple(regions[:MAX_REGIONS]), len(regions))
    for key in keys[MAX_KEYS:]:  # counted and named, not located
        diverged[key] = Divergence(())
    return Replicas(len(fp.keys), diverged)


def _minority(values: list[int]) -> list[int]:
    """The ranks whose value is not the majority's: the largest group of equal values (on a
    tie, the one holding the lowest rank) is taken for the right copy."""
    return _minority_of(dict(enumerate(values)))


def _minority_of(values: dict[int, int]) -> list[int]:
    """:func:`_minority` over some ranks only (rank -> value)."""
    groups: dict[int, list[int]] = {}
    for rank, v in sorted(values.items()):
        groups.setdefault(v, []).append(rank)
    best: list[int] = max(groups.values(), key=lambda g: (len(g), -g[0]))
    return [r for r in sorted(values) if r not in set(best)]
