"""Distributed metadata as ranks grow: planning, the commit and a restore's metadata, 8 to 8192
ranks.

No processes: every rank's inputs are generated in this one process and ``ckstore.distributed``
runs as one rank would, for a take on a cold plan cache ("first") and a later take of the same
layout ("cached"; fresh leaf objects, as a new take builds them). The state is
transformer-like: ``--layers`` blocks of attention and MLP weights plus an Adam moment per
weight, all DTensor Shard(0) over the world (FSDP2-style), ``--replicated`` small replicated
adapter tensors, and per-rank leaves (an RNG state that differs per rank, a buffer equal on
every rank, a step counter).

**Planning** is what a rank does before writing: its leaves' layout digests, the two
agreements (each rank's vectors are what an all-reduce gets; the maximum of identical vectors
is the vector itself), its assignment, and after hashing the equality of its per-rank leaves.
Rank 0 also groups the digests of the per-rank leaves that differ (``rank 0 groups``).

**The commit** (the manifest in parts, docs/FORMAT.md 7.7): each rank sends rank 0 its part's
id and size and its replicated pieces' ids (``sent/rank``: that record, the lengths gather and
the three per-key all-reduces), rank 0 receives the records and the all-reduced vectors
(``rank 0 recv``) and builds the root and the nodes over every rank's part (``commit``: decoding
the records, the replicated entries, the root, the nodes, serialising and hashing them; the
index transaction, whose chunk references the database copies from the staging session, is not
simulated). **A restore's metadata**: rank 1 opening the snapshot for its own shards, with as
many ranks as the take ("same") and with half as many ("half": each reads two ranks' pieces):
the bytes of the root, nodes and parts it reads against what its keys and regions need (a
manifest stored whole holding only its pieces), and the time to parse them into its view.

    python bench/plan_scale.py                        # 8 .. 8192 ranks
    python bench/plan_scale.py --ranks 8 64 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import blake3

from ckstore.distributed._classify import DTENSOR, LOCAL, REPLICATED, VALUE, Leaf, Local
from ckstore.distributed._parts import INTS, Record, root_of
from ckstore.distributed._plan import (
    SHARES,
    PlanCache,
    agree,
    assignment,
    header,
    ints62,
    key_vector,
    same,
    shares,
)
from ckstore.engine.config import DEFAULT_CHUNK_BYTES, DEFAULT_INLINE_BYTES, DEFAULT_PACK_BYTES
from ckstore.engine.manifests import parts_for, read_parts
from ckstore.engine.take.packing import TakeOptions
from ckstore.format.dtypes import itemsize
from ckstore.format.grid import make_grid
from ckstore.format.layout import Layout
from ckstore.format.manifest import ChunkRef, Manifest, TensorEntry, ValueEntry, canonical_json
from ckstore.format.parts import Part, Root, build_tree, parse_any, partial
from ckstore.format.tiling import uncovered

OPTS = TakeOptions(
    DEFAULT_CHUNK_BYTES, DEFAULT_PACK_BYTES, DEFAULT_INLINE_BYTES, threads=1, lease_seconds=60
)
WORD = 8  # bytes per all-reduced int


def shapes(layers: int, d: int, vocab: int) -> dict[str, list[int]]:
    """Global shapes of the model's weights (bf16)."""
    out = {"model/embed.weight": [vocab, d]}
    for i in range(layers):
        p = f"model/layers.{i}."
        for w in ("q", "k", "v", "o"):
            out[f"{p}attn.{w}.weight"] = [d, d]
        out[f"{p}mlp.up.weight"] = [4 * d, d]
        out[f"{p}mlp.down.weight"] = [d, 4 * d]
        out[f"{p}norm1.weight"] = [d]
        out[f"{p}norm2.weight"] = [d]
    out["model/norm.weight"] = [d]
    out["model/lm_head.weight"] = [vocab, d]
    return out


def shard0(shape: list[int], rank: int, world: int) -> list[list[int]]:
    """The box of ``rank``'s Shard(0) piece, split as torch.chunk does (trailing ranks may be empty)."""
    n = shape[0]
    step = -(-n // world)
    lo, hi = min(rank * step, n), min((rank + 1) * step, n)
    return [[lo] + [0] * (len(shape) - 1), [hi - lo] + shape[1:]]


def leaves_of(
    rank: int, world: int, weights: dict[str, list[int]], replicated: int, d: int
) -> Local:
    """One rank's leaves, as ``_classify.classify`` describes them."""
    leaves: dict[str, Leaf] = {}
    for app in ("model", "optim"):
        for key, shape in weights.items():
            k = key if app == "model" else f"optim/state.{key}.exp_avg"
            box = shard0(shape, rank, world)
            desc = {
                "t": DTENSOR,
                "dtype": "bfloat16",
                "shape": shape,
                "box": box,
                "container": "torch",
                "device": "cuda:0",
            }
            leaves[k] = Leaf(
                DTENSOR, desc, None, (tuple(box[0]), tuple(box[1])), [rank], Layout((world,), (0,))
            )
    for i in range(replicated):
        leaves[f"adapter/lora.{i}.weight"] = Leaf(
            REPLICATED,
            {
                "t": REPLICATED,
                "dtype": "float32",
                "shape": [16, d],
                "container": "torch",
                "device": "cuda:0",
            },
        )
    leaves["extra/rng"] = Leaf(
        LOCAL,
        {"t": LOCAL, "dtype": "uint8", "shape": [5056], "container": "torch", "device": "cpu"},
    )
    leaves["extra/loss_scale"] = Leaf(
        LOCAL,
        {"t": LOCAL, "dtype": "float32", "shape": [1024], "container": "torch", "device": "cpu"},
    )
    leaves["extra/step"] = Leaf(VALUE, {"t": VALUE, "value": 1000})
    apps: dict[str, Any] = {}
    for key in leaves:
        app, rest = key.split("/", 1)
        apps.setdefault(app, {"$cls": "dict", "$dict": []})["$dict"].append([rest, {"$ref": key}])
    return Local(apps=apps, leaves=leaves)


def _fake_id(*parts: Any) -> str:
    return blake3.blake3(repr(parts).encode()).hexdigest()


def plan_one(local: Local, world: int, rank: int, cache: PlanCache) -> tuple[Any, dict[str, int]]:
    """One rank's planning; returns its pieces and the bytes it sends per collective."""
    tree = blake3.blake3(canonical_json(local.apps)).hexdigest()
    head = header(local, tree) + [len(local.leaves), -len(local.leaves)]
    assert same(head, 0) and same(head, 2)
    vector = key_vector(local)
    agreed = agree(list(local.leaves), vector)
    mine = assignment(local, agreed, world, rank, OPTS, cache)
    own = {k: x for k, x in local.leaves.items() if x.kind in (LOCAL, VALUE)}
    digests = {k: _fake_id(k, rank if k == "extra/rng" else 0) for k in own}
    equality = [x for dg in digests.values() for a in ints62(dg.encode()) for x in (a, -a)]
    differing = [k for k in own if k == "extra/rng"]  # what the maxima say: the RNG state differs
    sent = {
        "plan": WORD * (len(head) + 1 + len(vector) + 1),  # + the phase flags
        "hash": WORD * (len(equality) + 1)
        + len(json.dumps([digests[k] for k in differing]))
        + WORD,
    }
    return mine, sent


def rank0_groups(world: int) -> float:
    """Rank 0 grouping the gathered digests of the differing per-rank leaves (one here)."""
    gathered = [[_fake_id("rng", r)] for r in range(world)]
    gc.collect()
    t = time.perf_counter()
    for n in range(1):
        by: dict[str, list[int]] = {}
        for r, ds in enumerate(gathered):
            by.setdefault(ds[n], []).append(r)
    return time.perf_counter() - t


def measure(world: int, a: argparse.Namespace) -> dict[str, Any]:
    weights = shapes(a.layers, a.d, a.vocab)
    rank = 1 % world

    def one(cache: PlanCache) -> tuple[float, Any, dict[str, int]]:
        local = leaves_of(
            rank, world, weights, a.replicated, a.d
        )  # every take describes its leaves anew
        gc.collect()
        t = time.perf_counter()
        mine, sent = plan_one(local, world, rank, cache)
        return time.perf_counter() - t, mine, sent

    first, cached = [], []
    for _ in range(a.rounds):
        cache = PlanCache()
        t1, mine, sent = one(cache)
        t2, again, _ = one(cache)
        assert again == mine and cache.hits == 1 and cache.misses == 1
        first.append(t1)
        cached.append(t2)
    out: dict[str, Any] = {
        "ranks": world,
        "keys": len(leaves_of(rank, world, weights, a.replicated, a.d).leaves),
        "pieces": len(mine),
        "plan_first_s": statistics.median(first),
        "plan_cached_s": statistics.median(cached),
        "sent_per_rank": sum(sent.values()),
        "rank0_groups_s": rank0_groups(world),
        **commit_sim(world, weights, a),
        **restore_sim(world, weights, a),
    }
    return out


# -- the commit and a restore's metadata (docs/FORMAT.md 7.7) ----------------------------------
HEADER = {"run": "r", "step": 1, "created_at": 0.0, "metadata": {}, "name": None, "session": "s"}
EQUAL = {"extra/loss_scale", "extra/step"}  # per-rank leaves equal on every rank: in the root


class _Guard:
    """What the root asks of the take's guard (the simulation measured nothing: no figures)."""

    def differs(self, key: str, entry: Any, rank: int | None = None, world: int = 1) -> bool:
        return True

    def summed(self, key: str, figures: Any, sumsq: float, same: bool) -> None:
        return None


def own_entries(local: Local, rank: int) -> dict[str, Any]:
    """A rank's per-rank values: its RNG state (its own bytes), the others equal everywhere."""
    out: dict[str, Any] = {}
    for key, leaf in local.leaves.items():
        x = leaf.desc
        if leaf.kind == VALUE:
            out[key] = ValueEntry(x["value"])
        elif leaf.kind == LOCAL:
            shape = tuple(x["shape"])
            cid = _fake_id(key, rank if key == "extra/rng" else 0)
            grid = make_grid(shape, itemsize(x["dtype"]), OPTS.chunk_bytes)
            refs = tuple(ChunkRef(o, s, cid) for o, s in grid.boxes())
            out[key] = TensorEntry(x["dtype"], shape, refs, grid.block, device="cpu")
    return out


def part_bytes(
    world: int, rank: int, weights: dict[str, list[int]], a: argparse.Namespace
) -> bytes:
    """Rank ``rank``'s part: its pieces (made-up ids) and its RNG state."""
    local = leaves_of(rank, world, weights, a.replicated, a.d)
    agreed = agree(list(local.leaves), key_vector(local))
    pieces: dict[str, list[ChunkRef]] = {}
    for key, (o, s) in assignment(local, agreed, world, rank, OPTS, None):
        if local.leaves[key].kind == DTENSOR:
            pieces.setdefault(key, []).append(ChunkRef(tuple(o), tuple(s), _fake_id(key, o)))
    own = {k: e for k, e in own_entries(local, rank).items() if k not in EQUAL}
    figures = {"new_bytes": 1, "new_chunks": 1, "reused_chunks": 0, "hashed_bytes": 1}
    return Part(rank, {k: tuple(v) for k, v in pieces.items()}, own, figures).to_json()


def _records(world: int, shares: list[Any], real: dict[int, bytes]) -> list[bytes]:
    size = len(next(iter(real.values())))
    out = []
    for r in range(world):
        part, n = (
            (blake3.blake3(real[r]).hexdigest(), len(real[r]))
            if r in real
            else (_fake_id("part", r), size)
        )
        out.append(
            Record(part, n, tuple(_fake_id("rep", r, i) for i in range(len(shares[r])))).to_bytes()
        )
    return out


def _commit(
    world: int, local: Local, agreed: Any, records: list[bytes]
) -> tuple[float, Any, list[bytes]]:
    """Rank 0's commit, timed: decode the records, build the tree and the root, hash them."""
    keys = len(local.leaves)
    summed = ([0] * (INTS * keys) + [1, 1, 0], [0.0] * keys, [1, 0, 0] * keys)
    layouts = {k: x.layout for k, x in local.leaves.items() if x.kind == DTENSOR}
    gc.collect()
    t = time.perf_counter()
    recs = [Record.from_bytes(x, r) for r, x in enumerate(records)]
    level, nodes = build_tree([(r.part, r.size) for r in recs])
    node_ids = [blake3.blake3(n).hexdigest() for n in nodes]
    c = root_of(
        _Guard(),  # type: ignore[arg-type]
        local,
        own_entries(local, 0),
        EQUAL,
        layouts,  # type: ignore[arg-type]
        agreed,
        recs,
        (level, node_ids),
        summed,
        lambda keys, found: {**HEADER, "world_size": world},
        OPTS,
    )
    raw = c.root.to_json()
    blake3.blake3(raw).hexdigest()
    return time.perf_counter() - t, raw, nodes


def commit_sim(world: int, weights: dict[str, list[int]], a: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's commit, first (cold caches) and cached, with what is sent and received."""
    local = leaves_of(0, world, weights, a.replicated, a.d)
    agreed = agree(list(local.leaves), key_vector(local))
    real = {r: part_bytes(world, r, weights, a) for r in {1 % world, 2 % world, 3 % world}}
    SHARES.clear()
    records = _records(world, shares(local, agreed, world, OPTS), real)
    vectors = WORD * (INTS * len(local.leaves) + 3 + len(local.leaves) + 3 * len(local.leaves))
    first, cached = [], []
    for _ in range(a.rounds):
        SHARES.clear()
        t1, raw, nodes = _commit(
            world, leaves_of(0, world, weights, a.replicated, a.d), agreed, records
        )
        t2, _, _ = _commit(world, leaves_of(0, world, weights, a.replicated, a.d), agreed, records)
        first.append(t1)
        cached.append(t2)
    _COMMITTED[world] = (raw, nodes, real)
    return {
        "commit_recv": WORD * world + sum(map(len, records)) + vectors,
        "commit_sent_per_rank": WORD + len(records[1 % world]) + vectors,
        "commit_first_s": statistics.median(first),
        "commit_cached_s": statistics.median(cached),
        "root_bytes": len(raw),
        "nodes": len(nodes),
        "part_bytes": len(real[1 % world]),
    }


_COMMITTED: dict[int, tuple[bytes, list[bytes], dict[int, bytes]]] = {}


def restore_sim(world: int, weights: dict[str, list[int]], a: argparse.Namespace) -> dict[str, Any]:
    """Rank 1 opening the committed snapshot for its regions: restored by as many ranks as the
    take ("same") and by half as many ("half")."""
    raw, nodes, real = _COMMITTED[world]
    objects_by_id = {blake3.blake3(x).hexdigest(): x for x in [*nodes, *real.values()]}
    out: dict[str, Any] = {}
    read: list[int] = []

    def fetch(ids: list[str]) -> dict[str, bytes]:
        got = {}
        for cid in ids:
            data = objects_by_id[cid]
            assert blake3.blake3(data).hexdigest() == cid  # as a chunk read verifies it
            read.append(len(data))
            got[cid] = data
        return got

    for case, ranks in (("same", world), ("half", max(1, world // 2))):
        rank = 1 % ranks
        regions: dict[str, Any] = {}
        for k, shape in _dtensor_shapes(weights).items():
            box = shard0(shape, rank, ranks)
            regions[k] = (tuple(box[0]), tuple(box[1]))
        regions["extra/rng"] = None
        times = []
        for _ in range(a.rounds):
            read.clear()
            gc.collect()
            t = time.perf_counter()
            assert blake3.blake3(raw).digest()
            root = parse_any(raw, "root")
            assert isinstance(root, Root)
            parts, ids = read_parts(root, parts_for(root, rank, regions), fetch, "root")
            view = partial(root, parts, rank, ids)
            for key, (o, s) in ((k, r) for k, r in regions.items() if r is not None):
                assert uncovered(o, s, view.entries[key].chunks) == 0  # type: ignore[union-attr]
            times.append(time.perf_counter() - t)
        need = Manifest(view.apps, _restricted(view, regions), view.snapshot).to_json()
        got = len(raw) + sum(read)
        out |= {
            f"open_{case}_s": statistics.median(times),
            f"metadata_{case}": got,
            f"metadata_{case}_x": got / len(need),
        }
    return out


def _dtensor_shapes(weights: dict[str, list[int]]) -> dict[str, list[int]]:
    out = dict(weights)
    out.update((f"optim/state.{k}.exp_avg", v) for k, v in weights.items())
    return out


def _restricted(view: Manifest, regions: dict[str, Any]) -> dict[str, Any]:
    """The view's entries with only the pieces overlapping each region: what the keys need."""
    out: dict[str, Any] = {}
    for key, e in view.entries.items():
        region = regions.get(key)
        if isinstance(e, TensorEntry) and region is not None and e.chunks:
            ro, rs = region
            keep = tuple(
                c
                for c in e.chunks
                if all(
                    max(a, b) < min(a + n, b + m) for a, n, b, m in zip(c.offsets, c.sizes, ro, rs)
                )
            )
            e = TensorEntry(e.dtype, e.shape, keep, e.block, container=e.container, device=e.device)
        out[key] = e
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024, 8192])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--replicated", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object per world size")
    a = ap.parse_args()
    if not a.json:
        print(
            "| ranks | keys | pieces/rank | plan first | plan cached | sent/rank (plan) "
            "| sent/rank (commit) | rank 0 recv | commit first | commit cached | root | part "
            "| restore metadata, same / half | x needed | open same / half |"
        )
        print("|---:" * 15 + "|")
    for world in a.ranks:
        m = measure(world, a)
        if a.json:
            print(json.dumps(m))
            continue
        print(
            f"| {world} | {m['keys']} | {m['pieces']} | {m['plan_first_s']:.3f} s "
            f"| {m['plan_cached_s']:.4f} s | {_size(m['sent_per_rank'])} "
            f"| {_size(m['commit_sent_per_rank'])} | {_size(m['commit_recv'])} "
            f"| {m['commit_first_s']:.3f} s | {m['commit_cached_s']:.3f} s "
            f"| {_size(m['root_bytes'])} + {m['nodes']} nodes | {_size(m['part_bytes'])} "
            f"| {_size(m['metadata_same'])} / {_size(m['metadata_half'])} "
            f"| {m['metadata_same_x']:.2f} / {m['metadata_half_x']:.2f} "
            f"| {m['open_same_s']:.3f} / {m['open_half_s']:.3f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
