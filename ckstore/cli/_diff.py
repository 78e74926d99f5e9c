"""``ckstore diff``: two snapshots compared key by key (with ``--numeric``, value by value).

The comparison is ``store.diff``; this prints it as a table, or ``--json``.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..format.health import describe
from . import _format as fmt
from ._command import Command
from ._common import EXIT_OK, emit_json, open_store

_MARK = {"added": "+", "removed": "-", "changed": "M", "unchanged": " "}


def cmd_diff(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        result = store.diff(args.a, args.b, numeric=args.numeric)
    if args.json:
        emit_json(result.to_dict())
        return EXIT_OK
    d = result.to_dict()
    print(f"a: {args.a} ({d['a']['id'][:12]})  b: {args.b} ({d['b']['id'][:12]})")
    for side in ("a", "b"):
        print(f"health {side}: {_side_health(d[side]['health'])}")
    shown = [k for k in d["keys"] if args.all or k["status"] != "unchanged" or _key_health(k)]
    if shown:
        print(
            fmt.table(
                _diff_headers(args.numeric),
                [_diff_row(k, args.numeric) for k in shown],
                right=(3, 4),
            )
        )
    c, b = d["counts"], d["bytes"]
    changed = f"{fmt.size(b['changed'])}; {fmt.size(b['changed_chunk_bytes'])} in changed chunks"
    parts = [f"{c['changed']} changed ({changed})"]
    parts += [f"{c[k]} {k} ({fmt.size(b[k])})" for k in ("added", "removed", "unchanged")]
    print(", ".join(parts))
    dl = d["b_deltas"]
    if dl["chunks"]:
        print(
            f"b stores {fmt.count(dl['new_chunks'], 'chunk')} beyond a in "
            f"{fmt.size(dl['new_stored_bytes'])}; "
            f"{dl['chunks']} are deltas: {fmt.size(dl['raw_bytes'])} raw in {fmt.size(dl['stored_bytes'])} "
            f"({fmt.size(dl['saved_bytes'])} saved)"
        )
    return EXIT_OK


def _diff_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="the old snapshot (a ref)")
    p.add_argument("b", help="the new snapshot (a ref)")
    p.add_argument(
        "--numeric",
        action="store_true",
        help="read changed chunks and report value differences",
    )
    p.add_argument("--all", action="store_true", help="also list unchanged keys")


DIFF = Command(
    "diff",
    "compare two snapshots key by key",
    (
        "ckstore diff sft@100 sft@200",
        "ckstore diff base best --numeric",
        "ckstore diff sft@100 best --json",
    ),
    cmd_diff,
    _diff_arguments,
    completes=("ref", "ref"),
)


def _side_health(h: dict[str, Any] | None) -> str:
    if h is None:
        return "not recorded"
    if h["nonfinite"] is None:
        out = "not measured"
    else:
        out = "ok" if h["nonfinite"] == 0 else f"UNHEALTHY: {h['nonfinite']} NaN/Inf"
    if h["stale"]:
        out += f"; stale: {describe(h['stale'])}"
    return out


def _key_health(k: dict[str, Any]) -> str:
    """The note a tensor's recorded health adds: NaN/Inf on side B, its norm a -> b."""
    a, b = k.get("health_a"), k.get("health_b")
    notes = []
    if b and (b["nan"] or b["inf"]):
        notes.append(f"NaN {b['nan']} Inf {b['inf']}")
    if k["status"] == "changed" and a and b and a["norm"] is not None and b["norm"] is not None:
        notes.append(f"norm {a['norm']:.4g} -> {b['norm']:.4g}")
    return ", ".join(notes)


def _diff_headers(numeric: bool) -> tuple[str, ...]:
    base = ("", "key", "dtype/shape", "bytes", "chunks", "note")
    return base + ("max|b-a|", "l2(b-a)", "l2(a)", "l2(b)") if numeric else base


def _diff_row(k: dict[str, Any], numeric: bool) -> tuple[Any, ...]:
    side = "a" if k["status"] == "removed" else "b"
    dtype, shape = k[f"dtype_{side}"], k[f"shape_{side}"]
    what = f"{dtype} {fmt.cell(shape)}" if dtype else k["kind"]
    chunks = ""
    if k.get("total_chunks"):
        chunks = f"{k['changed_chunks']}/{k['total_chunks']} ({k['chunk_fraction']:.0%})"
    elif k.get("chunk_fraction") is not None:
        chunks = f"{k['chunk_fraction']:.0%}"
    row: tuple[Any, ...] = (
        _MARK[k["status"]],
        k["key"],
        what,
        fmt.size(k[f"bytes_{side}"]),
        chunks,
        "; ".join(x for x in (k.get("reason"), _key_health(k)) if x),
    )
    if numeric:
        n = k.get("numeric") or {}
        row += tuple(n.get(f) for f in ("max_abs_diff", "l2_diff", "l2_a", "l2_b"))
    return row
