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

What counts as replicated is what the take stores once: DDP modules and ``replicated=`` globs.
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
from ..format.dtypes import itemsize
from ..format.grid import Box, make_grid
from ..format.health import MAX_REGIONS, Divergence, Replicas
from ..format.tensors import byte_view
from ._classify import Local
from ._plan import same
from .comm import Comm

MAX_KEYS = 16
"""Differing tensors located block by block and rank by rank (the others are counted)."""


@dataclass
class Fingerprints:
    """This rank's fingerprints of its replicated tensors (keys in leaf order, the same order
    on every rank once the plan agreed).

    Attributes:
        keys: the replicated tensors compared.
        blocks: key -> (region, 62-bit fingerprint) of each grid block, in grid order.
        whole: key -> 62-bit fingerprint of its blocks' fingerprints.
    """

    keys: list[str] = field(default_factory=list)
    blocks: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)


def fingerprints(
    local: Local, replicated: Iterable[str], opts: TakeOptions, threads: int = 1
) -> Fingerprints:
    """This rank's fingerprints of the replicated tensors (every block of its whole copy), on
    ``threads`` threads."""
    out = Fingerprints()
    chosen = set(replicated)
    views: list[memoryview] = []
    for key, leaf in local.leaves.items():
        if key not in chosen or leaf.tensor is None:
            continue
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
    for key in out.keys:
        out.blocks[key] = [(box, next(found)) for box, _ in out.blocks[key]]
        out.whole[key] = _combine(f for _, f in out.blocks[key])
    return out


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
    groups: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    keep = max(groups.values(), key=lambda g: (len(g), -g[0]))
    return [r for r in range(len(values)) if r not in set(keep)]
