"""``ckstore repair``: damaged local chunks healed from a remote that holds them.

One record (``cli/_command.py``) beside its handler.
"""

from __future__ import annotations

import argparse

from . import _format as fmt
from ._command import Command
from ._common import EXIT_OK, EXIT_PROBLEMS, open_store, print_report


def cmd_repair(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.repair(args.remote, progress=lambda it: fmt.progress(it, "packs"))
    d = report.to_dict()
    if args.json:
        print_report(d, True)
    else:
        print(f"healed: {len(d['healed'])}")
        print("\n".join(f"  - {cid[:16]} from {name}" for cid, name in d["healed"].items()))
        print(f"unrecoverable: {len(d['unrecoverable'])}")
        print("\n".join(f"  - {cid[:16]}" for cid in d["unrecoverable"]))
        if d["unreachable"]:
            print(f"remotes that could not be read: {len(d['unreachable'])}")
            print("\n".join(f"  - {name}: {why}" for name, why in d["unreachable"].items()))
        print(f"problems: {len(d['problems'])}")
        print("\n".join(f"  - {p}" for p in d["problems"]))
        print(f"ok: {d['ok']}")
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def _repair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from",
        dest="remote",
        metavar="REMOTE",
        default=None,
        help="the remote to fetch damaged chunks from (default: every configured remote that "
        "holds them, a two-tier store's tier remote among them)",
    )


REPAIR = Command(
    "repair",
    "heal damaged local chunks from a remote that holds them (exit 1 if damage stays)",
    ("ckstore repair", "ckstore repair --from backup --json"),
    cmd_repair,
    _repair_arguments,
    description=(
        "Read every pack whole (as check --read-data does), fetch each chunk whose local bytes "
        "are damaged from a remote that holds it, verify it against its id, write it into a "
        "new local pack (nothing is overwritten in place), then check again. Reports the "
        "chunks healed, those no remote could give back, and the problems left; exits 1 when "
        "anything stays damaged."
    ),
)
