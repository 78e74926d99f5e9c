"""The planning step of a distributed take, flat in world size, and a cache of plans.

No rank sends its leaf descriptions anywhere. Each rank plans its own part from what it
holds, and the ranks agree through two small all-reduces (``Comm.all_reduce_max``):

1. :func:`header`: a digest of what must be the same on every rank (the container tree, so the
   keys and their order; each DTensor key's dtype and global shape). Equal everywhere iff the
   maximum of it and of its negation agree. On a mismatch the ranks' descriptions are
   gathered (the error path only) to say which rank differs and how.
2. :func:`key_vector`: per key, whether this rank marks it replicated, whether it holds a plain
   value there, and a digest of a replicated tensor's dtype and shape; :func:`agree` turns the
   maxima into the keys replicated on every rank, those marked on some ranks only (kept per
   rank, "demoted"), and mismatches (raised alike on every rank).

Then :func:`assignment` gives this rank its pieces: the grid blocks of its DTensor shard cut
to its box, spread over the ranks holding the same box (a mesh dimension that replicates),
and its share of the replicated tensors, spread over every rank by bytes with a heap (the same
computation on every rank, over the replicated tensors only: O(pieces x log world), nothing
per rank). Both depend only on the layout, so the result is cached per process under
:func:`cache_key` (this rank's layout digest, the agreement, the world, the grid knobs); a
take of the same layout skips the assignment.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import blake3

from ..engine.take.packing import TakeOptions
from ..errors import DistributedError
from ..format.boxes import pieces
from ..format.dtypes import itemsize
from ..format.grid import Box, make_grid
from ..format.layout import writer
from ..format.manifest import canonical_json
from ._classify import DTENSOR, LOCAL, REPLICATED, VALUE, Local

CACHE_SIZE = 8
"""Assignments kept per process (a few layouts: e.g. a model state and an optimizer-only state)."""

Assignment = tuple[tuple[str, Box], ...]  # this rank's (key, piece) to hash and write


class Loads:
    """Bytes given to each rank so far; the least-loaded rank of a set, or of all ranks."""

    def __init__(self, world: int) -> None:
        self.load = [0] * world
        self._heap = [(0, r) for r in range(world)]  # (load, rank); stale entries are skipped

    def least(self, ranks: list[int] | None = None) -> int:
        """The least-loaded of ``ranks`` (None: of every rank), the lowest rank on ties."""
        if ranks is None or len(ranks) == len(self.load):
            heap, load = self._heap, self.load
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            return heap[0][1]
        return min(ranks, key=lambda q: (self.load[q], q))

    def reset(self) -> None:
        """Rebuild the heap after ``load`` was changed directly (bulk updates)."""
        self._heap = [(x, r) for r, x in enumerate(self.load)]
        heapq.heapify(self._heap)

    def add(self, rank: int, nbytes: int) -> None:
        self.load[rank] += nbytes
        heapq.heappush(self._heap, (self.load[rank], rank))


def ints62(data: bytes) -> tuple[int, int]:
    """Two 62-bit integers of the BLAKE3 of ``data`` (124 bits to compare across ranks)."""
    d = blake3.blake3(data).digest()
    return int.from_bytes(d[:8], "little") >> 2, int.from_bytes(d[8:16], "little") >> 2


def same(maxed: list[int], at: int = 0) -> bool:
    """Whether the pair at ``at`` of a max-reduced ``[x, -x]`` shows one value on every rank."""
    return maxed[at] == -maxed[at + 1]


# -- agreement ----------------------------------------------------------------------------------
def header(local: Local, tree: str) -> list[int]:
    """``[a, -a, b, -b]``: the digest of what every rank must share (see the module docstring)."""
    dtensors = [
        [k, x.desc["dtype"], x.desc["shape"]] for k, x in local.leaves.items() if x.kind == DTENSOR
    ]
    a, b = ints62(canonical_json([tree, dtensors]))
    return [a, -a, b, -b]


def in_step(maxed: list[int], number: int, run: str, step: int | None) -> bool:
    """From a plan phase's maxima (``[..., number, -number, which, -which]`` at 6-9): whether
    every rank runs the same take (True), or whether this rank should plan again with the
    others' next take (False): async takes out of step, one rank's ``async_take`` having raised
    before its background part began, and this rank is ahead.

    Raises:
        DistributedError: this rank's take has no partner (it is behind: given up, the later
            takes go on), or the ranks run different takes (a caller's bug).
    """
    if same(maxed, 6) and same(maxed, 8):
        return True
    at = run if step is None else f"{run}@{step}"
    if number < maxed[6]:
        raise DistributedError(
            f"distributed take: the ranks are not taking the same snapshot: this rank's async "
            f"take of {at} (number {number} here) has no partner; another rank is at number "
            f"{maxed[6]} (an async_take of it raised, or was not called, on some rank). Nothing "
            "of it is committed; the later takes go on"
        )
    if number == -maxed[7]:  # the same number everywhere: different takes
        raise DistributedError(
            f"distributed take: the ranks are not taking the same snapshot: this rank takes {at}, "
            "another rank a different run, step or name; call it with the same ones on every rank"
        )
    return False


def key_vector(local: Local) -> list[int]:
    """Per key (in this rank's order, the same everywhere once :func:`header` agreed): whether
    it is marked replicated, whether it is a plain value, and a replicated tensor's dtype and
    shape digest; each as ``x, -x``."""
    out: list[int] = []
    for leaf in local.leaves.values():
        m = int(leaf.kind == REPLICATED)
        v = int(leaf.kind == VALUE)
        s = (
            ints62(canonical_json([leaf.desc["dtype"], leaf.desc["shape"], "data" in leaf.desc]))[0]
            if m
            else 0
        )
        out += [m, -m, v, -v, s, -s]
    return out


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on: the keys replicated on every rank, and those demoted."""

    replicated: frozenset[str]
    demoted: tuple[str, ...]


def agree(keys: list[str], maxed: list[int]) -> Agreed:
    """Read the max-reduced :func:`key_vector`; the same on every rank (so is any error).

    A key counts as replicated only if every rank marks it so (its globs or DDP), as in
    TorchSnapshot; one marked on some ranks only is kept per rank.
    """
    replicated, demoted = set(), []
    for n, key in enumerate(keys):
        m_max, m_min, v_max, s_same = (
            maxed[6 * n],
            -maxed[6 * n + 1],
            maxed[6 * n + 2],
            same(maxed, 6 * n + 4),
        )
        if not m_max:
            continue
        if v_max:
            raise DistributedError(
                f"distributed take: key {key!r} is a replicated tensor on some ranks and a plain value on others"
            )
        if m_min:
            if not s_same:
                raise DistributedError(
                    f"distributed take: key {key!r} has different dtype/shape on different ranks"
                )
            replicated.add(key)
        else:
            demoted.append(key)
    return Agreed(frozenset(replicated), tuple(demoted))


# -- assignment ---------------------------------------------------------------------------------
def layout_digest(local: Local) -> str:
    """A digest of this rank's layout: per leaf its kind, dtype, shape, DTensor box and
    replicas, and whether it is inlined; values and tensor bytes left out."""
    parts = []
    for key, leaf in local.leaves.items():
        x = leaf.desc
        if leaf.kind in (DTENSOR, REPLICATED, LOCAL):
            parts.append(
                [key, leaf.kind, x["dtype"], x["shape"], x.get("box"), leaf.replicas, "data" in x]
            )
        else:
            parts.append([key, leaf.kind])
    return blake3.blake3(canonical_json(parts)).hexdigest()


def cache_key(local: Local, agreed: Agreed, world: int, rank: int, opts: TakeOptions) -> str:
    """The digest an assignment is cached under."""
    return blake3.blake3(
        canonical_json(
            [
                layout_digest(local),
                sorted(agreed.replicated),
                list(agreed.demoted),
                world,
                rank,
                opts.chunk_bytes,
                opts.inline_bytes,
            ]
        )
    ).hexdigest()


class PlanCache:
    """A small LRU of plans (assignments, shares) by :func:`cache_key`; ``hits`` and ``misses``
    count lookups."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._plans: OrderedDict[str, Any] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> Any:
        found = self._plans.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._plans.move_to_end(key)
        return found

    def clear(self) -> None:
        """Forget every plan (and the counts)."""
        self._plans.clear()
        self.hits = self.misses = 0

    def put(self, key: str, value: Any) -> None:
        self._plans[key] = value
        self._plans.move_to_end(key)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)


CACHE = PlanCache()
SHARES = PlanCache()
"""Every rank's share of the replicated tensors, by layout (the rank that commits reads them)."""


def assignment(
    local: Local,
    agreed: Agreed,
    world: int,
    rank: int,
    opts: TakeOptions,
    cache: PlanCache | None = CACHE,
) -> Assignment:
    """The pieces this rank hashes and writes (see the module docstring); cached.

    ``local``'s DTensor leaves carry ``replicas``: the ranks (within the take) holding the same
    box, this one included.
    """
    key = cache_key(local, agreed, world, rank, opts) if cache is not None else ""
    found = cache.get(key) if cache is not None else None
    if found is not None:
        return found
    mine = tuple(_dtensor_pieces(local, rank, opts)) + tuple(
        shares(local, agreed, world, opts, SHARES if cache is not None else None)[rank]
    )
    if cache is not None:
        cache.put(key, mine)
    return mine


def _dtensor_pieces(local: Local, rank: int, opts: TakeOptions) -> list[tuple[str, Box]]:
    """The pieces of this rank's DTensor shards it writes: piece ``j`` of a box held by ``n``
    ranks goes to the ``(j + crc32(key)) % n``-th of them (``layout.writer``: each computes the
    same, and so does a reader looking for the part that records it)."""
    out = []
    for key, leaf in local.leaves.items():
        if leaf.kind != DTENSOR:
            continue
        assert leaf.box is not None
        x = leaf.desc
        grid = make_grid(tuple(x["shape"]), itemsize(x["dtype"]), opts.chunk_bytes)
        holders = sorted(leaf.replicas) or [rank]
        for j, piece in enumerate(pieces(grid, leaf.box)):
            if writer(key, j, holders) == rank:  # readers locate the piece by the same rule
                out.append((key, piece))
    return out


def shares(
    local: Local, agreed: Agreed, world: int, opts: TakeOptions, cache: PlanCache | None = SHARES
) -> list[list[tuple[str, Box]]]:
    """:func:`replicated_share`, cached per layout like assignments."""
    key = cache_key(local, agreed, world, -1, opts) if cache is not None else ""
    found = cache.get(key) if cache is not None else None
    if found is None:
        found = replicated_share(local, agreed, world, opts)
        if cache is not None:
            cache.put(key, found)
    return found


def replicated_share(
    local: Local, agreed: Agreed, world: int, opts: TakeOptions
) -> list[list[tuple[str, Box]]]:
    """Every rank's share of the replicated tensors' pieces: each piece to the least-loaded
    rank by bytes (a heap; the lowest rank on ties). The same on every rank."""
    loads = Loads(world)
    out: list[list[tuple[str, Box]]] = [[] for _ in range(world)]
    for key, leaf in local.leaves.items():
        if key not in agreed.replicated:
            continue
        x = leaf.desc
        size = itemsize(x["dtype"])
        grid = make_grid(tuple(x["shape"]), size, opts.chunk_bytes)
        if grid.nbytes <= opts.inline_bytes:
            continue  # inline, from rank 0's leaf
        for piece in grid.boxes():
            r = loads.least()
            loads.add(r, math.prod(piece[1]) * size)
            out[r].append((key, piece))
    return out


def check_tiling(key: str, shape: list[int], holders: dict[Box, list[int]]) -> None:
    """Refuse DTensor shards that do not cover the tensor (error path: gathered boxes)."""
    covered = sum(math.prod(b[1]) for b in holders)
    if covered != math.prod(shape):
        raise DistributedError(
            f"distributed take: the shards of DTensor {key!r} cover {covered} of "
            f"{math.prod(shape)} elements (only Shard(d) and Replicate placements are supported)"
        )


def describe(local: Local) -> dict[str, Any]:
    """This rank's layout as JSON, for the error path that names a rank whose state differs."""
    return {
        "leaves": {
            k: {kk: vv for kk, vv in x.desc.items() if kk not in ("data", "value")}
            for k, x in local.leaves.items()
        }
    }
