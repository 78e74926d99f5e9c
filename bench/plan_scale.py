"""Distributed planning as ranks grow: one rank's planning time and bytes, 8 to 8192 ranks.

No processes: every rank's inputs are generated in this one process and the planner of
``ckstore.distributed`` runs as one rank would (rank 1, a rank like any other but
rank 0), for a take on a cold plan cache ("first") and a later take of the same layout
("cached"; fresh leaf objects, as a new take builds them). The state is transformer-like:
``--layers`` blocks of attention and MLP weights plus an Adam moment per weight, all DTensor
Shard(0) over the world (FSDP2-style), ``--replicated`` small replicated adapter tensors, and
per-rank leaves (an RNG state that differs per rank, a buffer equal on every rank, a step
counter).

Planning is what a rank does before writing: its leaves' layout digests, the two agreements
(each rank's vectors are what an all-reduce gets; the maximum of identical vectors is the
vector itself), its assignment (its DTensor pieces, its share of the replicated pieces),
and after hashing the equality of its per-rank leaves. Rank 0 also groups the digests of the
per-rank leaves that differ (``rank 0 groups``): O(world x differing leaves), the only
planning work that grows with the world.

Bytes: what one rank (not 0) sends in the planning and hashing collectives (``sent/rank``;
it receives as much back) and its report to rank 0 at the end of the write phase. Rank 0
receives every rank's report for the manifest (``commit recv``) and decodes them (``commit
decode``, measured up to ``--commit-max`` ranks): the manifest holds every rank's pieces, so
that part is the snapshot's own size, not planning.

    python bench/plan_scale.py                        # 8 .. 8192 ranks
    python bench/plan_scale.py --ranks 8 64 --rounds 1
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
from ckstore.distributed._plan import PlanCache, agree, assignment, header, ints62, key_vector, same
from ckstore.engine.config import DEFAULT_CHUNK_BYTES, DEFAULT_INLINE_BYTES, DEFAULT_PACK_BYTES
from ckstore.engine.take.packing import TakeOptions
from ckstore.format.manifest import canonical_json

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
            leaves[k] = Leaf(DTENSOR, desc, None, (tuple(box[0]), tuple(box[1])), [rank])
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
    return Local(apps={"apps": sorted({k.split("/")[0] for k in leaves})}, leaves=leaves)


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


def report(mine: Any, rank: int) -> bytes:
    """This rank's report to rank 0 after writing (pieces with made-up ids, figures)."""
    pieces: dict[str, list[Any]] = {}
    for key, (o, s) in mine:
        pieces.setdefault(key, []).append([list(o), list(s), _fake_id(key, o)])
    doc = {
        "figures": {
            "new_bytes": 1,
            "new_chunks": 1,
            "reused_chunks": 0,
            "written_raw_bytes": 1,
            "hashed_bytes": 1,
        },
        "pieces": pieces,
        "own": {
            "extra/rng": {
                "kind": "tensor",
                "dtype": "uint8",
                "shape": [5056],
                "container": "torch",
                "device": "cpu",
                "block": [5056],
                "chunks": [[[0], [5056], _fake_id("rng", rank)]],
            }
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


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
        "report_per_rank": len(report(mine, rank)),
        "rank0_groups_s": rank0_groups(world),
    }
    if world <= a.commit_max:
        reports = [
            report(
                assignment(
                    leaves_of(r, world, weights, a.replicated, a.d),
                    agree(
                        list(leaves_of(r, world, weights, a.replicated, a.d).leaves),
                        key_vector(leaves_of(r, world, weights, a.replicated, a.d)),
                    ),
                    world,
                    r,
                    OPTS,
                    None,
                ),
                r,
            )
            for r in range(world)
        ]
        gc.collect()
        t = time.perf_counter()
        decoded = [json.loads(x) for x in reports]
        out["commit_decode_s"] = time.perf_counter() - t
        out["commit_recv"] = sum(map(len, reports))
        del decoded
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024, 8192])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--replicated", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--commit-max",
        type=int,
        default=1024,
        help="measure rank 0's commit decode up to this world",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per world size")
    a = ap.parse_args()
    if not a.json:
        print(
            "| ranks | keys | pieces/rank | plan first | plan cached | sent/rank | report/rank | rank 0 groups | commit recv (rank 0) | commit decode (rank 0) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in a.ranks:
        m = measure(world, a)
        if a.json:
            print(json.dumps(m))
            continue
        commit = (
            (_size(m["commit_recv"]), f"{m['commit_decode_s']:.3f} s")
            if "commit_recv" in m
            else ("-", "-")
        )
        print(
            f"| {world} | {m['keys']} | {m['pieces']} | {m['plan_first_s']:.3f} s | {m['plan_cached_s']:.4f} s | "
            f"{_size(m['sent_per_rank'])} | {_size(m['report_per_rank'])} | {m['rank0_groups_s']:.4f} s | {commit[0]} | {commit[1]} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
