"""``ckstore cat REF KEY``: one stored entry, without restoring anything.

A value is printed as JSON. A tensor is summarised: dtype, shape, bytes, and statistics of
its values (min, max, mean, std, L2 norm, NaN and infinity counts, the first few values),
computed in float64 from the tensor's own chunks only (``read_object``, every chunk
verified). torch is imported only for a tensor, so ``cat`` of a value stays light.
"""

from __future__ import annotations

import argparse
import base64
import difflib
import json
from typing import Any

from ..errors import InvalidInputError, KeyNotFoundError
from ..format.manifest import ValueEntry
from . import _format as fmt
from ._args import REF_HELP
from ._command import Command
from ._common import EXIT_OK, emit_json, open_store

HEAD = 8
"""Values shown from the start of a tensor (flattened)."""


def cmd_cat(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        entry = snap.manifest.entries.get(args.key)
        if entry is None:
            raise _not_an_entry(snap, args.key)
        if isinstance(entry, ValueEntry):
            doc: dict[str, Any] = {"key": args.key, "kind": "value", "value": jsonable(entry.value)}
        else:
            obj = snap.read_object(args.key)
            tensors = obj if entry.kind == "per_rank" else [obj]
            doc = {"key": args.key, "kind": entry.kind, "snapshot": snap.ref}
            summaries = [summary(t) for t in tensors]
            if entry.kind == "per_rank":
                doc["ranks"] = summaries
            else:
                doc.update(summaries[0])
    if args.json:
        emit_json(doc)
    elif doc["kind"] == "value":
        print(json.dumps(doc["value"], indent=2))
    else:
        print(_human(doc))
    return EXIT_OK


def _cat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("key", help="one entry's key, as `ckstore ls REF` lists them")


CAT = Command(
    "cat",
    "print one stored value, or a tensor's dtype, shape and value statistics",
    (
        "ckstore cat sft@100 progress/step",
        "ckstore cat best model/lm_head.weight",
        "ckstore cat sft optim/param_groups/0/lr --json",
    ),
    cmd_cat,
    _cat_arguments,
    completes=("ref", "key"),
)


def _not_an_entry(snap: Any, key: str) -> Exception:
    below = [k for k in snap.manifest.entries if k.startswith(key.rstrip("/") + "/")]
    if below:
        shown = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
        return InvalidInputError(
            f"{key!r} is a group of {fmt.count(len(below), 'entry', 'entries')} in snapshot "
            f"{snap.ref}, not one entry: "
            f"cat one of {shown} (`ckstore ls {_ref(snap)} {key}` lists them)"
        )
    near = difflib.get_close_matches(key, list(snap.manifest.entries), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return KeyNotFoundError(
        f"no key {key!r} in snapshot {snap.ref}{hint} (`ckstore ls {_ref(snap)}` lists the keys)"
    )


def _ref(snap: Any) -> str:
    return snap.run if snap.step is None else f"{snap.run}@{snap.step}"


def jsonable(value: Any) -> Any:
    """A manifest value as JSON: tuples as lists, bytes as ``{"base64": ...}``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def summary(t: Any) -> dict[str, Any]:
    """dtype, shape, bytes and value statistics of a tensor (or NumPy array)."""
    import torch

    if not isinstance(t, torch.Tensor):
        t = torch.from_numpy(t)
    out: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "numel": t.numel(),
        "nbytes": t.numel() * t.element_size(),
    }
    if t.numel() == 0 or t.is_complex():
        return out
    x = t.detach().reshape(-1).to(torch.float64)
    finite = x[torch.isfinite(x)]
    out.update(
        nan=int(torch.isnan(x).sum()),
        inf=int(torch.isinf(x).sum()),
        min=float(finite.min()) if finite.numel() else None,
        max=float(finite.max()) if finite.numel() else None,
        mean=float(finite.mean()) if finite.numel() else None,
        std=float(finite.std(correction=0)) if finite.numel() else None,
        norm=float(torch.linalg.vector_norm(finite)) if finite.numel() else None,
        zeros=int((x == 0).sum()),
        head=[_number(v) for v in t.reshape(-1)[:HEAD].tolist()],
    )
    return out


def _number(v: Any) -> Any:
    return v if isinstance(v, (bool, int)) or v == v and abs(v) != float("inf") else str(v)


def _human(doc: dict[str, Any]) -> str:
    lines = [("key", doc["key"]), ("snapshot", doc["snapshot"])]
    for i, s in enumerate(doc.get("ranks", [doc])):
        prefix = f"rank {i} " if "ranks" in doc else ""
        lines += [
            (f"{prefix}dtype", s["dtype"]),
            (f"{prefix}shape", fmt.cell(s["shape"])),
            (f"{prefix}bytes", fmt.size(s["nbytes"])),
        ]
        for k in ("min", "max", "mean", "std", "norm", "nan", "inf", "zeros"):
            if k in s:
                lines.append((f"{prefix}{k}", fmt.cell(s[k])))
        if "head" in s:
            more = ", ..." if s["numel"] > HEAD else ""
            lines.append(
                (f"{prefix}head", "[" + ", ".join(fmt.cell(v) for v in s["head"]) + more + "]")
            )
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in lines)
