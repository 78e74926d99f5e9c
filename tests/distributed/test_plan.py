"""The distributed planner on generated inputs (no processes): heap assignment, plan cache."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from ckstore.distributed._classify import DTENSOR, LOCAL, REPLICATED, VALUE
from ckstore.distributed._plan import PlanCache, layout_digest, plan
from ckstore.distributed.take import _writers
from ckstore.engine.packing import TakeOptions
from ckstore.errors import DistributedError
from ckstore.format.boxes import pieces
from ckstore.format.dtypes import itemsize
from ckstore.format.grid import make_grid

OPTS = TakeOptions(chunk_bytes=256, pack_bytes=4096, inline_bytes=32, threads=1, lease_seconds=60)


def _descs(world: int, rows: int = 37, mixed: bool = False, step: int = 1) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        per = -(-rows // world)
        lo, hi = min(r * per, rows), min((r + 1) * per, rows)
        leaves: dict[str, Any] = {}
        for i in range(3):
            leaves[f"m/w{i}"] = {"t": DTENSOR, "dtype": "float32", "shape": [rows, 5 + i],
                                 "box": [[lo, 0], [hi - lo, 5 + i]], "container": "torch", "device": "cpu"}
        for i in range(4):
            leaves[f"ddp/b{i}"] = {"t": REPLICATED, "dtype": "bfloat16", "shape": [50 + 7 * i, 3], "container": "torch", "device": "cpu"}
        leaves["ddp/tiny"] = {"t": REPLICATED, "dtype": "float32", "shape": [2], "container": "torch", "device": "cpu", "data": "AAAAAAAAAAA="}
        leaves["x/mixed"] = {"t": REPLICATED if (mixed and r % 2) else LOCAL, "dtype": "float32", "shape": [100], "container": "torch", "device": "cpu"}
        leaves["x/step"] = {"t": VALUE, "value": step}
        out.append({"ok": True, "tree": "t", "leaves": leaves, "layout": layout_digest(leaves)})
    return json.loads(json.dumps(out))  # as the gather delivers them


def _naive_assign(descs: list[dict[str, Any]], world: int) -> list[list[Any]]:
    """The planner before heaps: a scan of every holder for every piece."""
    load = [0] * world
    out: list[list[Any]] = [[] for _ in range(world)]
    for key, x in descs[0]["leaves"].items():
        if x["t"] not in (DTENSOR, REPLICATED):
            continue
        shape, size = tuple(x["shape"]), itemsize(x["dtype"])
        grid = make_grid(shape, size, OPTS.chunk_bytes)
        if x["t"] == REPLICATED:
            if grid.nbytes <= OPTS.inline_bytes:
                continue
            groups = [(list(range(world)), list(grid.boxes()))]
        else:
            holders: dict[Any, list[int]] = {}
            for r, d in enumerate(descs):
                b = d["leaves"][key]["box"]
                holders.setdefault((tuple(b[0]), tuple(b[1])), []).append(r)
            groups = [(rs, list(pieces(grid, box))) for box, rs in holders.items()]
        for ranks, boxes in groups:
            for p in boxes:
                r = min(ranks, key=lambda q: (load[q], q))
                load[r] += math.prod(p[1]) * size
                out[r].append((key, p))
    return out


@pytest.mark.parametrize("world", [1, 3, 8, 40])
def test_heap_assignment_equals_the_scan_of_every_rank(world: int) -> None:
    descs = _descs(world)
    got = plan(copy.deepcopy(descs), OPTS, cache=None)
    assert [list(a) for a in got.assignment] == _naive_assign(descs, world)
    assert sum(len(a) for a in got.assignment) > world  # replicated pieces spread over ranks


def test_cached_plan_equals_uncached_and_values_do_not_miss() -> None:
    cache = PlanCache()
    first = plan(_descs(8, mixed=True), OPTS, cache)
    again = _descs(8, mixed=True, step=2)  # a later take: same layout, other values
    cached = plan(again, OPTS, cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert cached == first == plan(_descs(8, mixed=True, step=2), OPTS, cache=None)
    assert cached.demoted == ("x/mixed",)
    assert {d["leaves"]["x/mixed"]["t"] for d in again} == {LOCAL}  # a hit still demotes per rank


@pytest.mark.parametrize("change", ["rows", "world", "kind", "chunk"])
def test_a_changed_layout_misses_the_cache(change: str) -> None:
    cache = PlanCache()
    base = plan(_descs(8), OPTS, cache)
    opts = OPTS
    args: dict[str, Any] = {"world": 8}
    if change == "rows":
        args["rows"] = 45
    elif change == "world":
        args["world"] = 6
    elif change == "kind":
        args["mixed"] = True
    else:
        opts = TakeOptions(chunk_bytes=128, pack_bytes=4096, inline_bytes=32, threads=1, lease_seconds=60)
    other = plan(_descs(**args), opts, cache)
    assert cache.misses == 2 and cache.hits == 0
    assert other == plan(_descs(**args), opts, cache=None) and other != base


def test_a_hit_never_skips_a_mismatch_it_has_not_seen() -> None:
    cache = PlanCache()
    plan(_descs(4), OPTS, cache)
    bad = _descs(4)
    bad[2]["leaves"]["m/w0"]["shape"] = [99, 5]
    bad[2]["layout"] = layout_digest(bad[2]["leaves"])
    with pytest.raises(DistributedError, match="m/w0"):
        plan(bad, OPTS, cache)


def test_writers_one_per_chunk_id_least_loaded_holder() -> None:
    world = 5
    descs = _descs(world)
    results = []
    for r in range(world):
        chunks = {"m/w0": [[[r], [1, 5], f"own{r}"]], "x/mixed": [[[0], [100], "same"]]}
        if r in (1, 3):
            chunks["m/w1"] = [[[0], [10, 6], "dup13"]]
        nbytes = 4 * (5 + 100 + (60 if r in (1, 3) else 0))
        results.append({"chunks": chunks, "bytes": nbytes})
    owners = _writers(results, descs, world)
    assert {owners[f"own{r}"] for r in range(world)} == set(range(world))
    assert owners["dup13"] == 1  # both holders equally loaded: the lower rank
    assert owners["same"] == 0  # held by every rank: least loaded is rank 0 (no dup13 bytes)
    no_shared = [{"chunks": {"m/w0": [[[r], [1, 5], f"own{r}"]]}, "bytes": 20} for r in range(world)]
    assert _writers(no_shared, descs, world) == {f"own{r}": r for r in range(world)}
