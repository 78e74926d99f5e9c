"""The ``verify`` command: check an exported file or folder against the digests it carries.

No store is opened. Safetensors files and everything ``ckstore-digests.json`` lists are checked
with BLAKE3 alone; torch is imported only to name the tensor of a damaged torch file, and only
if it is installed (else the file is named).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import NotFoundError
from . import _format as fmt
from ._command import Command
from ._common import EXIT_CORRUPT, EXIT_OK, EXIT_PROBLEMS, emit_json


def cmd_verify(args: argparse.Namespace) -> int:
    from ..format.verify import verify_path

    if not os.path.exists(args.path):
        raise NotFoundError(f"nothing at {args.path!r}")
    report = verify_path(args.path, torch_tensors=_torch_tensors(), strict=args.strict)
    d = report.to_dict()
    if args.json:
        emit_json(d)
    else:
        _print(d)
    if report.ok:
        return EXIT_OK
    return EXIT_PROBLEMS if report.nothing_to_check else EXIT_CORRUPT


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", help="an exported file or folder (safetensors, torch, DCP, Hugging Face)"
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a file no digest covers fails too (default: listed as unverified, which passes "
        "when the folder has no ckstore-digests.json)",
    )


VERIFY = Command(
    "verify",
    "check an exported file or folder against its digests (no store needed)",
    (
        "ckstore verify ./hf-out",
        "ckstore verify ./hf-out/model.safetensors",
        "ckstore verify ./ckpt --json",
        "ckstore verify ./hf-out --strict",
    ),
    cmd_verify,
    _verify_arguments,
    description=(
        "Check an exported file or folder against the BLAKE3 digests ckstore wrote with it (a "
        "safetensors file's own metadata, ckstore-digests.json beside the files). Needs no store; "
        "torch only to name the damaged tensor of a torch file. Beside ckstore-digests.json, a file "
        "it does not list is damage too, and only regular files inside the folder are read; without "
        "it, a file no digest covers is listed as unverified, and with --strict it fails. Exit 0 "
        "when everything matches, 5 when something does not (named), 1 when there is nothing to "
        "check against."
    ),
    completes=("file",),
)


def _torch_tensors() -> Any:
    def load(path: str) -> Any:
        # torch, only for a damaged torch file; without it (ImportError) the file is named
        from ..interop import torch_file_digests

        return torch_file_digests(path)

    return load


def _print(d: dict[str, Any]) -> None:
    for p in d["problems"]:
        where = f"{p['file']}: tensor {p['tensor']!r}" if p["tensor"] else p["file"]
        label = "UNVERIFIED" if p["problem"].startswith("no digest covers") else "DAMAGED"
        print(f"{label}  {where}: {p['problem']}")
    for name in d["unverified"]:
        if not any(p["file"] == name for p in d["problems"]):
            print(f"unverified  {name} (no digest covers it; --strict fails on it)")
    verdict = "ok" if d["ok"] else "FAILED"
    print(
        f"{verdict}: {fmt.count(d['files'], 'file')}, {fmt.count(d['tensors'], 'tensor')} checked "
        "against their BLAKE3 digests"
    )
