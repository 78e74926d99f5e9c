"""The remote commands: ``remote add|list|rm``, ``push``, ``pull`` and ``clone``.

Each ``cmd_*`` takes the parsed arguments and returns an exit code. ``push``, ``pull`` and
``clone`` show a progress bar (bytes looked at) on a terminal, then their figures: snapshots,
chunks and bytes sent, and what the other side had already (``--json``: one document).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..engine.progress import ProgressFn
from . import _format as fmt
from ._common import EXIT_OK, emit_json, open_store, print_report, storage_options


def cmd_remote(args: argparse.Namespace) -> int:
    action = getattr(args, "remote_command", None) or "list"
    if action == "add":
        with open_store(args) as store:
            opts = _remote_options(args)
            rec = store.add_remote(
                args.name, args.url, index=args.remote_index, storage_options=opts or None
            )
        out = _remote_dict(rec)
        if args.json:
            emit_json(out)
        else:
            print(
                f"added remote {rec.name}: {rec.url}"
                + (f" (index {rec.index})" if rec.index else "")
            )
        return EXIT_OK
    if action == "rm":
        with open_store(args) as store:
            store.remove_remote(args.name)
        if args.json:
            emit_json({"removed": args.name})
        else:
            print(f"removed remote {args.name} (the remote store itself is untouched)")
        return EXIT_OK
    with open_store(args) as store:
        rows = [_remote_dict(r) for r in store.remotes()]
        held: dict[str, int] = {}
        for status in store.push_status().values():
            for name in status.remotes:
                held[name] = held.get(name, 0) + 1
    for r in rows:
        r["snapshots_held"] = held.get(r["name"], 0)
    if args.json:
        emit_json(rows)
        return EXIT_OK
    if not rows:
        print("no remotes (add one with `ckstore remote add NAME URL`)")
        return EXIT_OK
    table = [
        (r["name"], r["url"], r["index"] or "-", "tier" if r["tier"] else "", r["snapshots_held"])
        for r in rows
    ]
    print(fmt.table(("name", "url", "index", "role", "snapshots held"), table, right=(4,)))
    return EXIT_OK


def _remote_dict(rec: Any) -> dict[str, Any]:
    return {
        "name": rec.name,
        "url": rec.url,
        "index": rec.index,
        "tier": rec.tier,
        "store_id": rec.store_id,
        "storage_options": sorted(rec.options),
    }  # the keys only


def _remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """``remote add``'s own ``-o KEY=VALUE`` (the remote's storage options)."""
    ns = argparse.Namespace(storage_option=getattr(args, "remote_option", None) or [])
    return storage_options(ns)


def cmd_push(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.push(args.remote, args.refs, force=args.force, progress=_bar(args))
    _print(report.to_dict(), args.json)
    return EXIT_OK


def cmd_pull(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.pull(args.remote, args.refs, force=args.force, progress=_bar(args))
    _print(report.to_dict(), args.json)
    return EXIT_OK


def cmd_clone(args: argparse.Namespace) -> int:
    import ckstore

    store = ckstore.clone(
        args.url,
        args.dest,
        index=args.index,
        storage_options=storage_options(args) or None,
        dest_index=args.dest_index,
        progress=_bar(args),
    )
    try:
        snaps = len(store.log())
        d = {
            "destination": store.url,
            "remote": "origin",
            "source": args.url,
            "snapshots": snaps,
            "tags": len(store.tags()),
        }
    finally:
        store.close()
    _print(d, args.json)
    return EXIT_OK


def _print(d: dict[str, Any], as_json: bool) -> None:
    if not as_json and "bytes_per_second" in d:
        d = {**d, "bytes_per_second": f"{fmt.size(d['bytes_per_second'])}/s"}
    print_report(d, as_json)


def _bar(args: argparse.Namespace) -> ProgressFn | None:
    """Bars over the stored bytes sent or found at the other side, on a terminal (none with
    ``--json``, whose figures say it all)."""
    return None if args.json else fmt.bar()
