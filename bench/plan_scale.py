"""Distributed planning as ranks grow: time per take and metadata bytes per rank, 8 to 1024 ranks.

No processes: the planning inputs of every rank are generated in this one process, exactly as
the two gathers of a distributed take deliver them (JSON), and the planner of
``ckstore.distributed`` runs on them as one rank would. The state is transformer-like: ``--layers``
blocks of attention and MLP weights plus an Adam moment per weight, all DTensor Shard(0) over
the world (FSDP2-style), ``--replicated`` small replicated adapter tensors, and per-rank
leaves (an RNG state that differs per rank, a buffer equal on every rank, a step counter).

Columns: ``keys``; ``sent/rank`` and ``recv/rank``: JSON bytes one rank sends and receives in
the planning and hashing gathers; ``decode``: parsing what one rank receives; ``plan first``:
the structure check and the assignment on a cold cache, plus choosing each chunk's writer;
``plan cached``: the same for a second take of the same layout (fresh descriptions, so only
the plan is reused). Times are the median of ``--rounds``, each after a ``gc.collect()`` so
that the simulation's own garbage is not collected inside the timed region.

    python bench/plan_scale.py                       # 8 .. 1024 ranks
    python bench/plan_scale.py --ranks 8 64 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from typing import Any

import blake3

from ckstore.distributed._classify import DTENSOR, LOCAL, REPLICATED, VALUE
from ckstore.distributed._plan import PlanCache, layout_digest, plan
from ckstore.distributed.take import _writers
from ckstore.engine.config import DEFAULT_CHUNK_BYTES, DEFAULT_INLINE_BYTES, DEFAULT_PACK_BYTES
from ckstore.engine.packing import TakeOptions

OPTS = TakeOptions(DEFAULT_CHUNK_BYTES, DEFAULT_PACK_BYTES, DEFAULT_INLINE_BYTES, threads=1, lease_seconds=60)


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


def descriptions(rank: int, world: int, weights: dict[str, list[int]], replicated: int, d: int) -> dict[str, Any]:
    """One rank's planning message, as ``dist._take.take`` builds it."""
    leaves: dict[str, Any] = {}
    for app in ("model", "optim"):
        for key, shape in weights.items():
            k = key if app == "model" else f"optim/state.{key}.exp_avg"
            leaves[k] = {"t": DTENSOR, "dtype": "bfloat16", "shape": shape, "box": shard0(shape, rank, world),
                         "container": "torch", "device": "cuda:0"}
    for i in range(replicated):
        leaves[f"adapter/lora.{i}.weight"] = {"t": REPLICATED, "dtype": "float32", "shape": [16, d], "container": "torch", "device": "cuda:0"}
    leaves["extra/rng"] = {"t": LOCAL, "dtype": "uint8", "shape": [5056], "container": "torch", "device": "cpu"}
    leaves["extra/loss_scale"] = {"t": LOCAL, "dtype": "float32", "shape": [1024], "container": "torch", "device": "cpu"}
    leaves["extra/step"] = {"t": VALUE, "value": 1000}
    tree = blake3.blake3(json.dumps(sorted({k.split("/")[0] for k in leaves})).encode()).hexdigest()
    return {"ok": True, "tree": tree, "leaves": leaves, "layout": layout_digest(leaves)}


def chunk_lists(mine: Any, rank: int) -> dict[str, Any]:
    """One rank's hashing message: its pieces and per-rank tensors with (made-up) chunk ids."""
    lists: dict[str, list[Any]] = {}
    nbytes = 5056 + 4096
    for key, (o, s) in mine:
        lists.setdefault(key, []).append([list(o), list(s), blake3.blake3(f"{key}{o}".encode()).hexdigest()])
        nbytes += math.prod(s) * (2 if key.startswith(("model", "optim")) else 4)
    lists["extra/rng"] = [[[0], [5056], blake3.blake3(f"rng{rank}".encode()).hexdigest()]]
    lists["extra/loss_scale"] = [[[0], [1024], blake3.blake3(b"loss_scale").hexdigest()]]
    return {"ok": True, "chunks": lists, "bytes": nbytes}


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    weights = shapes(args.layers, args.d, args.vocab)
    raw = [json.dumps(descriptions(r, world, weights, args.replicated, args.d), separators=(",", ":")).encode() for r in range(world)]
    t0 = time.perf_counter()
    descs = [json.loads(b) for b in raw]
    decode = time.perf_counter() - t0
    the_plan = plan(descs, OPTS, cache=None)
    hashed = [json.dumps(chunk_lists(the_plan.assignment[r], r), separators=(",", ":")).encode() for r in range(world)]
    t0 = time.perf_counter()
    results = [json.loads(b) for b in hashed]
    decode += time.perf_counter() - t0

    def one(cache: PlanCache) -> float:
        fresh = [json.loads(b) for b in raw]  # every take gathers new descriptions
        gc.collect()  # not the simulation's own garbage
        t = time.perf_counter()
        plan(fresh, OPTS, cache)
        _writers(results, fresh, world)
        return time.perf_counter() - t

    first, cached = [], []
    for _ in range(args.rounds):
        cache = PlanCache()
        first.append(one(cache))
        cached.append(one(cache))
        assert cache.hits == 1 and cache.misses == 1
    sent = (sum(map(len, raw)) + sum(map(len, hashed))) / world
    return {
        "ranks": world, "keys": len(descs[0]["leaves"]), "sent_per_rank": sent, "recv_per_rank": sent * world,
        "decode_s": decode, "plan_first_s": statistics.median(first), "plan_cached_s": statistics.median(cached),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 256, 512, 1024])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--replicated", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object per world size")
    args = ap.parse_args()
    if not args.json:
        print("| ranks | keys | sent/rank | recv/rank | decode | plan first | plan cached |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        m = measure(world, args)
        if args.json:
            print(json.dumps(m))
            continue
        print(f"| {world} | {m['keys']} | {_size(m['sent_per_rank'])} | {_size(m['recv_per_rank'])} | "
              f"{m['decode_s']:.3f} s | {m['plan_first_s']:.3f} s | {m['plan_cached_s']:.3f} s |", flush=True)


if __name__ == "__main__":
    main()
