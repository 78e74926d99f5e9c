"""The distributed take's planner on generated inputs (no processes): agreement by maxima,
each rank's own assignment, the plan cache, one writer per chunk id."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from ckstore.distributed._classify import DTENSOR, LOCAL, REPLICATED, VALUE, Leaf, Local
from ckstore.distributed._plan import (
    PlanCache,
    agree,
    assignment,
    header,
    key_vector,
    replicated_share,
    same,
)
from ckstore.distributed.take import _writes
from ckstore.engine.take.packing import Chunk, TakeOptions
from ckstore.errors import DistributedError
from ckstore.format.boxes import pieces
from ckstore.format.dtypes import itemsize
from ckstore.format.grid import make_grid
from ckstore.format.manifest import ChunkRef, TensorEntry

OPTS = TakeOptions(chunk_bytes=256, pack_bytes=4096, inline_bytes=32, threads=1, lease_seconds=60)


def _local(rank: int, world: int, rows: int = 37, mixed: bool = False, replicas: int = 1) -> Local:
    """Rank ``rank``'s leaves: DTensor Shard(0) over ``world // replicas`` shards (each held by
    ``replicas`` ranks: a replicating mesh dimension), replicated and per-rank tensors, a value."""
    shards = world // replicas
    s, group = (
        rank // replicas,
        list(range(rank // replicas * replicas, (rank // replicas + 1) * replicas)),
    )
    per = -(-rows // shards)
    lo, hi = min(s * per, rows), min((s + 1) * per, rows)
    leaves: dict[str, Leaf] = {}
    for i in range(3):
        desc = {
            "t": DTENSOR,
            "dtype": "float32",
            "shape": [rows, 5 + i],
            "box": [[lo, 0], [hi - lo, 5 + i]],
            "container": "torch",
            "device": "cpu",
        }
        leaves[f"m/w{i}"] = Leaf(DTENSOR, desc, None, ((lo, 0), (hi - lo, 5 + i)), group)
    for i in range(4):
        leaves[f"ddp/b{i}"] = Leaf(
            REPLICATED,
            {
                "t": REPLICATED,
                "dtype": "bfloat16",
                "shape": [50 + 7 * i, 3],
                "container": "torch",
                "device": "cpu",
            },
        )
    leaves["ddp/tiny"] = Leaf(
        REPLICATED,
        {
            "t": REPLICATED,
            "dtype": "float32",
            "shape": [2],
            "container": "torch",
            "device": "cpu",
            "data": "AAAAAAAAAAA=",
        },
    )
    kind = REPLICATED if (mixed and rank % 2) else LOCAL
    leaves["x/mixed"] = Leaf(
        kind, {"t": kind, "dtype": "float32", "shape": [100], "container": "torch", "device": "cpu"}
    )
    leaves["x/step"] = Leaf(VALUE, {"t": VALUE, "value": 1})
    return Local(apps={"m": "tree"}, leaves=leaves)


def _maxed(vectors: list[list[int]]) -> list[int]:
    return [max(col) for col in zip(*vectors)]


def _plans(world: int, **kw: Any) -> list[tuple[Any, ...]]:
    locs = [_local(r, world, **kw) for r in range(world)]
    h = _maxed([header(x, "tree") for x in locs])
    assert same(h, 0) and same(h, 2)
    agreed = agree(list(locs[0].leaves), _maxed([key_vector(x) for x in locs]))
    return [assignment(locs[r], agreed, world, r, OPTS, cache=None) for r in range(world)]


@pytest.mark.parametrize(("world", "replicas"), [(1, 1), (3, 1), (8, 1), (8, 2), (40, 4)])
def test_every_piece_has_exactly_one_writer(world: int, replicas: int) -> None:
    plans = _plans(world, replicas=replicas)
    got = Counter((k, p) for plan in plans for k, p in plan)
    assert set(got.values()) == {1}
    loc = _local(0, world, replicas=replicas)
    for key, leaf in loc.leaves.items():
        if leaf.kind == LOCAL or key == "ddp/tiny" or leaf.kind == VALUE:
            continue
        x = leaf.desc
        grid = make_grid(tuple(x["shape"]), itemsize(x["dtype"]), OPTS.chunk_bytes)
        mine = [p for k, p in got if k == key]
        assert sum(math.prod(p[1]) for p in mine) == math.prod(x["shape"]), (
            key
        )  # they tile the tensor
        if leaf.kind == REPLICATED:
            assert sorted(mine) == sorted(grid.boxes())
    if replicas > 1:  # a box held by several ranks: its pieces spread over them
        writers = {r for r, plan in enumerate(plans) for k, _ in plan if k == "m/w0"}
        assert len(writers) >= world // replicas  # (more where a box has several pieces)


def _naive_share(loc: Local, replicated: set[str], world: int) -> list[list[Any]]:
    """The replicated assignment without heaps: a scan of every rank for every piece."""
    load = [0] * world
    out: list[list[Any]] = [[] for _ in range(world)]
    for key, leaf in loc.leaves.items():
        if key not in replicated:
            continue
        size = itemsize(leaf.desc["dtype"])
        grid = make_grid(tuple(leaf.desc["shape"]), size, OPTS.chunk_bytes)
        if grid.nbytes <= OPTS.inline_bytes:
            continue
        for p in grid.boxes():
            r = min(range(world), key=lambda q: (load[q], q))
            load[r] += math.prod(p[1]) * size
            out[r].append((key, p))
    return out


@pytest.mark.parametrize("world", [1, 3, 8, 40])
def test_heap_share_equals_the_scan_of_every_rank(world: int) -> None:
    loc = _local(0, world)
    agreed = agree(list(loc.leaves), key_vector(loc))
    assert replicated_share(loc, agreed, world, OPTS) == _naive_share(
        loc, set(agreed.replicated), world
    )


def test_agreement_replicated_demoted_and_refused() -> None:
    locs = [_local(r, 4, mixed=True) for r in range(4)]
    agreed = agree(list(locs[0].leaves), _maxed([key_vector(x) for x in locs]))
    assert agreed.demoted == ("x/mixed",)
    assert agreed.replicated == {f"ddp/b{i}" for i in range(4)} | {"ddp/tiny"}
    bad = [_local(r, 4) for r in range(4)]
    bad[2].leaves["ddp/b0"].desc["shape"] = [99, 3]
    with pytest.raises(DistributedError, match="ddp/b0"):
        agree(list(bad[0].leaves), _maxed([key_vector(x) for x in bad]))
    bad = [_local(r, 4) for r in range(4)]
    bad[1].leaves["ddp/b1"] = Leaf(VALUE, {"t": VALUE, "value": 3})
    with pytest.raises(DistributedError, match="ddp/b1.*plain value"):
        agree(list(bad[0].leaves), _maxed([key_vector(x) for x in bad]))


def test_header_differs_when_a_dtensor_layout_differs() -> None:
    locs = [_local(r, 4) for r in range(4)]
    locs[3].leaves["m/w1"].desc["shape"] = [38, 6]
    h = _maxed([header(x, "tree") for x in locs])
    assert not (same(h, 0) and same(h, 2))


def test_cached_assignment_equals_uncached_and_changes_miss() -> None:
    cache = PlanCache()
    loc = _local(1, 8, mixed=True)
    agreed = agree(list(loc.leaves), key_vector(loc))
    first = assignment(loc, agreed, 8, 1, OPTS, cache)
    again = _local(1, 8, mixed=True)
    again.leaves["x/step"].desc["value"] = 2  # a later take: same layout, other values
    assert (
        assignment(again, agreed, 8, 1, OPTS, cache)
        == first
        == assignment(loc, agreed, 8, 1, OPTS, cache=None)
    )
    assert (cache.hits, cache.misses) == (1, 1)
    assignment(_local(1, 8, rows=45), agreed, 8, 1, OPTS, cache)  # a shape
    assignment(_local(1, 6), agreed, 6, 1, OPTS, cache)  # the world
    assignment(
        loc, agreed, 8, 1, TakeOptions(128, 4096, 32, threads=1, lease_seconds=60), cache
    )  # the grid
    assignment(
        loc, agree(list(loc.leaves), key_vector(_local(0, 8))), 8, 1, OPTS, cache
    )  # the agreement
    assert (cache.hits, cache.misses) == (1, 5)


def test_values_held_alike_are_written_once() -> None:
    """A per-rank tensor equal on every rank, or within a group of ranks: each chunk written
    by one rank of those holding it; a value of one rank alone by that rank."""
    world = 4

    class FakeComm:
        def __init__(self, rank: int) -> None:
            self.rank, self.world = rank, world

    def entry(tag: str) -> TensorEntry:
        return TensorEntry(
            "float32",
            (6, 2),
            tuple(ChunkRef((i, 0), (1, 2), f"{tag}{i}".ljust(64, "0")) for i in range(6)),
            (1, 2),
        )

    written: list[str] = []
    for r in range(world):
        own = {"same": entry("a"), "pair": entry("b" if r % 2 else "c"), "mine": entry(f"d{r}")}
        leaves = {k: Leaf(LOCAL, {"t": LOCAL}) for k in own}
        chunks = []
        for k, e in own.items():
            for c in e.chunks:
                ch = Chunk(k, memoryview(b"x"), 4, False)
                ch.id = c.id
                chunks.append((k, (c.offsets, c.sizes), ch))
        local = Local(apps={}, leaves=leaves, chunks=chunks)
        groups = {"pair": [1, 3] if r % 2 else [0, 2]}
        written += [c.id for c in _writes(local, own, {"same"}, groups, FakeComm(r))]  # type: ignore[arg-type]
    got = Counter(written)
    assert set(got.values()) == {1}
    assert len(got) == 6 + 2 * 6 + 4 * 6  # "same" once, "pair" once per group, "mine" per rank


def test_pieces_of_a_box_are_cut_by_the_grid() -> None:  # the building block of every assignment
    grid = make_grid((10, 4), 4, 32)
    assert list(pieces(grid, ((3, 0), (4, 4)))) == [
        ((3, 0), (1, 4)),
        ((4, 0), (2, 4)),
        ((6, 0), (1, 4)),
    ]
