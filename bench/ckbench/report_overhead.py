"""The training-loop scenario's targets (issue "Training does not feel it") and its markdown
section, judged on ckstore with its peers beside it:

- the 10 steps after an ``async_take`` at most 5% slower than the same steps without
  checkpointing (a take every 10 steps)
- wall-clock overhead with a take every 10 steps at most 3%
- ``async_take`` blocking at most 1.2x one memcpy of the state from the second call of a
  process, and the first call at most 2x

and the staging budget's (``scenarios/budget.py``): peak RSS above the live state at most the
budget plus the largest chunk, at each budget measured.
"""

from __future__ import annotations

from typing import Any

from .util import fmt_b, fmt_s

SLOWDOWN_LIMIT = 0.05
OVERHEAD_LIMIT = 0.03
BLOCK_LIMIT = 1.2
FIRST_BLOCK_LIMIT = 2.0
K = "10"


def _row(name: str, value: float | None, limit: float, peers: str = "") -> dict[str, Any]:
    verdict = "n/a" if value is None else "PASS" if value <= limit else "MISS"
    return {"target": name, "value": value, "limit": limit, "verdict": verdict, "peers": peers}


def _peers(summary: dict[str, Any], field: str, k: str = K) -> str:
    per = summary.get(k, {}).get("systems", {})
    return ", ".join(
        f"{n} {_pct(v[field]['median'])}" for n, v in per.items() if n != "ckstore" and field in v
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: ckstore's value, the limit, the verdict and the peers' values."""
    s = out.get("summary", {})
    ck = s.get(K, {}).get("systems", {}).get("ckstore", {})
    first = s.get("first_block_over_memcpy", {})
    return [
        _row(
            "10 steps after an async_take: mean slowdown against plain steps (k=10)",
            ck.get("slowdown_after", {}).get("median"),
            SLOWDOWN_LIMIT,
            _peers(s, "slowdown_after"),
        ),
        _row(
            "wall-clock overhead, a take every 10 steps",
            ck.get("overhead", {}).get("median"),
            OVERHEAD_LIMIT,
            _peers(s, "overhead"),
        ),
        _row(
            "async_take blocking from the second call / one memcpy of the state",
            ck.get("block_over_memcpy"),
            BLOCK_LIMIT,
            ", ".join(
                f"{n} {v['block_over_memcpy']:.2f}x"
                for n, v in s.get(K, {}).get("systems", {}).items()
                if n != "ckstore" and v.get("block_over_memcpy") is not None
            ),
        ),
        _row(
            "first async_take of a process blocking / one memcpy of the state",
            first.get("ckstore"),
            FIRST_BLOCK_LIMIT,
            ", ".join(f"{n} {v:.2f}x" for n, v in first.items() if n != "ckstore"),
        ),
    ]


def markdown(out: dict[str, Any]) -> list[str]:
    """The section: the model, one table per interval, the targets."""
    m = out["model"]
    s = out["summary"]
    L = [
        f"## Training loop: a checkpoint every k steps ({fmt_b(out['state_bytes'])} state)",
        "",
        f"TinyGPT dim {m['dim']}, {m['layers']} layers, vocabulary {m['vocab']}, AdamW; torch on "
        f"{out['torch_threads']} of {out['cpus']} CPUs. One memcpy of the state: "
        f"{fmt_s(out['memcpy_seconds'])}{_samples(out.get('memcpy_samples', []))}. "
        "First checkpoint of the process blocks: "
        + ", ".join(f"{n} {fmt_s(v)}" for n, v in out["first_block"].items() if n != "plain")
        + ".",
    ]
    for k in (key for key in s if key.isdigit()):
        per = s[k]["systems"]
        step = s[k]["plain_step"]["median"]
        L += [
            "",
            f"k = {k} (plain step median {fmt_s(step)}); medians over cycles [min, max]:",
            "",
            "| system | blocks | / memcpy | 10 steps after a take | wall-clock overhead "
            "| waits per take | CPU outside the trainer per take "
            "| per step after a take: + running, + waiting for a core, + sleeping "
            "| retention per take (not in the overhead) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, v in per.items():
            L.append(
                f"| {n} | {fmt_s(v['block']['median'])} | "
                + (f"{v['block_over_memcpy']:.2f}x" if v["block_over_memcpy"] else "n/a")
                + f" | {_spread(v['slowdown_after'])} | {_spread(v['overhead'])} | "
                f"{fmt_s(v['wait_per_take']['median'])} | "
                f"{fmt_s(v['background_cpu_per_take']['median'])} | {_extra(v)} | "
                f"{_seconds(v.get('tidy_per_take', {}))} |"
            )
    if out.get("unavailable"):
        L += ["", "unavailable: " + "; ".join(f"{n}: {e}" for n, e in out["unavailable"].items())]
    L += ["", "| target | ckstore | limit | verdict | peers |", "|---|---|---|---|---|"]
    for r in out["targets"]:
        pct = "x" not in r["target"] and "/" not in r["target"]
        value = "n/a" if r["value"] is None else _pct(r["value"]) if pct else f"{r['value']:.2f}x"
        limit = f"{r['limit']:.0%}" if pct else f"{r['limit']}x"
        L.append(f"| {r['target']} | {value} | {limit} | {r['verdict']} | {r['peers']} |")
    return L


def _extra(v: dict[str, Any]) -> str:
    parts = v.get("step_extra", {})
    if not parts or parts["cpu"]["median"] is None:
        return "n/a"
    return ", ".join(f"{parts[f]['median'] * 1000:+.1f} ms" for f in ("cpu", "run_delay", "sleep"))


def _samples(xs: list[float]) -> str:
    """`` (median of N, min-max)`` for the memcpy's samples, empty for one."""
    if len(xs) < 2:
        return ""
    return f" (median of {len(xs)}, {fmt_s(min(xs))}-{fmt_s(max(xs))})"


def _seconds(sp: dict[str, Any]) -> str:
    return "n/a" if sp.get("median") is None else fmt_s(sp["median"])


def _spread(sp: dict[str, Any]) -> str:
    if sp.get("median") is None:
        return "n/a"
    return f"{sp['median']:+.1%} [{sp['min']:+.1%}, {sp['max']:+.1%}]"
