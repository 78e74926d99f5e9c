"""The planning step of a distributed take, and a cache of plans across takes of one layout.

A plan says, from every rank's gathered leaf descriptions, which keys the snapshot holds (rank
0's order), which keys some ranks mark replicated and others not (kept per rank), and which
pieces of the DTensor and replicated tensors each rank hashes and writes. It depends only on
the *layout*: each rank's container tree, and per leaf its kind, dtype, shape, DTensor box and
whether it is inlined; never on values or tensor bytes. A training loop takes the same layout
again and again, so the plan is cached under a digest of every rank's layout digest (each rank
computes its own with :func:`layout_digest` before the gather), the world size and the knobs
that shape the grid. A hit skips the structure check and the assignment; it never changes the
result (the plan is a pure function of what the key digests), and a changed layout on any
rank is a different key.

Assignment is greedy by bytes: each piece goes to the least-loaded rank (ties: lowest rank)
among those that hold it. A piece every rank holds (replicated tensors) takes the least-loaded
rank from a heap with lazy deletion, in O(log world), not a scan of every rank.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import blake3

from ..engine.packing import TakeOptions
from ..errors import DistributedError
from ..format.boxes import pieces
from ..format.dtypes import itemsize
from ..format.grid import Box, make_grid
from ..format.manifest import canonical_json
from ._classify import DTENSOR, LOCAL, REPLICATED, check_same_structure, demote_mixed

CACHE_SIZE = 8
"""Plans kept per process (a few layouts: e.g. a model state and an optimizer-only state)."""


@dataclass(frozen=True)
class Plan:
    """Everything the take derives from the layout alone (the same on every rank)."""

    keys: tuple[str, ...]
    demoted: tuple[str, ...]
    assignment: tuple[tuple[tuple[str, Box], ...], ...]  # per rank: (key, piece) to hash and write


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


def layout_digest(leaves: dict[str, dict[str, Any]]) -> str:
    """A digest of one rank's leaf descriptions, values and inline bytes left out."""
    parts = []
    for key, x in leaves.items():
        if x["t"] in (DTENSOR, REPLICATED, LOCAL):
            parts.append([key, x["t"], x["dtype"], x["shape"], x.get("box"), "data" in x])
        else:
            parts.append([key, x["t"]])
    return blake3.blake3(canonical_json(parts)).hexdigest()


def cache_key(descs: list[dict[str, Any]], opts: TakeOptions) -> str:
    """The digest a plan is cached under: every rank's tree and layout digest, world, knobs."""
    h = blake3.blake3(canonical_json([len(descs), opts.chunk_bytes, opts.inline_bytes]))
    for d in descs:
        h.update(f"{d['tree']}:{d['layout']};".encode())
    return h.hexdigest()


class PlanCache:
    """A small LRU of plans by :func:`cache_key`; ``hits`` and ``misses`` count lookups."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> Plan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
            return None
        self.hits += 1
        self._plans.move_to_end(key)
        return plan

    def put(self, key: str, plan: Plan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)


CACHE = PlanCache()


def plan(descs: list[dict[str, Any]], opts: TakeOptions, cache: PlanCache | None = CACHE) -> Plan:
    """The plan for these gathered descriptions; marks demoted keys per rank in ``descs``.

    With a cache, descriptions must carry ``layout`` (see :func:`layout_digest`). Raises
    :class:`DistributedError` when the ranks' states do not fit together (checked on a miss; a
    hit means these exact layouts passed the check before).
    """
    key = cache_key(descs, opts) if cache is not None else None
    found = cache.get(key) if cache is not None and key is not None else None
    if found is not None:
        _mark_demoted(descs, found.demoted)
        return found
    demoted = tuple(demote_mixed(descs))
    keys = check_same_structure(descs)
    result = Plan(tuple(keys), demoted, assign(descs, keys, opts, len(descs)))
    if cache is not None and key is not None:
        cache.put(key, result)
    return result


def _mark_demoted(descs: list[dict[str, Any]], demoted: Iterable[str]) -> None:
    for k in demoted:
        for d in descs:
            x = d["leaves"].get(k)
            if x is not None:
                x["t"] = LOCAL


def assign(descs: list[dict[str, Any]], keys: list[str], opts: TakeOptions, world: int) -> tuple[tuple[tuple[str, Box], ...], ...]:
    """Which pieces each rank hashes and writes, for DTensor and replicated entries.

    Deterministic: every rank computes the same answer from the same descriptions.
    """
    loads = Loads(world)
    out: list[list[tuple[str, Box]]] = [[] for _ in range(world)]
    for key in keys:
        x0 = descs[0]["leaves"][key]
        kind = x0["t"]
        if kind not in (DTENSOR, REPLICATED):
            continue
        shape, size = tuple(x0["shape"]), itemsize(x0["dtype"])
        grid = make_grid(shape, size, opts.chunk_bytes)
        groups: list[tuple[list[int] | None, list[Box]]]
        if kind == REPLICATED:
            if grid.nbytes <= opts.inline_bytes:
                continue  # inline, from rank 0's description
            groups = [(None, list(grid.boxes()))]
        else:
            groups = [(ranks, list(pieces(grid, box))) for box, ranks in _holders(descs, key, shape).items()]
        for ranks, boxes in groups:
            for piece in boxes:
                r = loads.least(ranks)
                loads.add(r, math.prod(piece[1]) * size)
                out[r].append((key, piece))
    return tuple(tuple(x) for x in out)


def _holders(descs: list[dict[str, Any]], key: str, shape: tuple[int, ...]) -> dict[Box, list[int]]:
    holders: dict[Box, list[int]] = {}
    for r, d in enumerate(descs):
        b = d["leaves"][key]["box"]
        holders.setdefault((tuple(b[0]), tuple(b[1])), []).append(r)
    covered = sum(math.prod(b[1]) for b in holders)
    if covered != math.prod(shape):
        raise DistributedError(
            f"distributed take: the shards of DTensor {key!r} cover {covered} of "
            f"{math.prod(shape)} elements (only Shard(d) and Replicate placements are supported)"
        )
    return holders
