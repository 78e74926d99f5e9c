"""The maintenance commands: ``gc``, ``check``, ``du``, ``reindex`` and ``migrate``.

Each ``cmd_*`` takes the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import _format as fmt
from ._common import EXIT_OK, EXIT_PROBLEMS, emit_json, find_store, open_store, print_report


# --- gc, check, reindex, du ---------------------------------------------------------------------
def gc_policy(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``store.gc`` that the options given ask for."""
    policy: dict[str, Any] = {"dry_run": args.dry_run, "keep_tagged": not args.no_keep_tagged,
                              "keep_healthy": not args.no_keep_healthy}
    for opt, key in (
        ("keep_last", "keep_last"),
        ("keep_every_steps", "keep_every_steps"),
        ("older_than", "older_than"),
        ("runs", "runs"),
        ("grace", "grace_seconds"),
        ("repack_below", "repack_below"),
    ):
        value = getattr(args, opt)
        if value is not None:
            policy[key] = value
    return policy


def cmd_gc(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.gc(**gc_policy(args))
    d = report.to_dict()
    print_report(d, args.json)
    if d.get("grace_kept_bytes") and not args.json:
        print(_grace_note(d))
    return EXIT_OK


def _grace_note(d: dict[str, Any]) -> str:
    """Why gc left bytes behind, and when they go (the grace period protects live readers)."""
    return (
        f"note: the {fmt.duration(d['grace_seconds'])} grace period kept "
        f"{fmt.size(d['grace_kept_bytes'])} that nothing references ({d['grace_kept_chunks']} "
        f"chunks, {d['grace_kept_packs']} retired packs); `ckstore gc` reclaims it after "
        f"{fmt.when(d['grace_expires_at'])} (a pack that pruning empties is deleted one grace "
        "period later), or now with --grace 0s if no take or restore is running"
    )


def cmd_check(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.check(read_data=args.read_data, progress=lambda it: fmt.progress(it, "packs"))
    print_report(report.to_dict(), args.json)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_reindex(args: argparse.Namespace) -> int:
    # the store must exist, its index need not: reindex rebuilds a fresh (or moved-aside) one
    with open_store(args, create_index=True) as store:
        report = store.reindex()
    print_report(report.to_dict(), args.json)
    return EXIT_OK if not report.skipped else EXIT_PROBLEMS


def cmd_du(args: argparse.Namespace) -> int:
    from ..history.du import du

    with open_store(args) as store:
        rows = du(store.repository, progress=lambda it: fmt.progress(it, "packs"))
    if args.json:
        emit_json({"runs": [r.to_dict() for r in rows[:-1]], "total": rows[-1].to_dict()})
        return EXIT_OK
    table = [
        (
            r.run if r.run is not None else "(total)",
            r.snapshots,
            fmt.size(r.logical_bytes),
            fmt.size(r.stored_bytes),
            r.chunks,
            fmt.ratio(r.dedup_ratio),
        )
        for r in rows
    ]
    print(
        fmt.table(
            ("run", "snapshots", "logical", "stored", "chunks", "ratio"),
            table,
            right=(1, 2, 3, 4, 5),
        )
    )
    total = rows[-1]
    print(f"packs on the backend: {total.packs}, {fmt.size(total.pack_bytes)}")
    for r in rows:
        if r.delta_chunks:
            print(
                f"deltas in {r.run if r.run is not None else 'the store'}: {r.delta_chunks} chunks, "
                f"{fmt.size(r.delta_raw_bytes)} raw stored in {fmt.size(r.delta_bytes)} "
                f"({fmt.size(r.delta_saved_bytes)} saved)"
            )
    return EXIT_OK


# --- migrate ------------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> int:
    from ..engine.repository import default_index_url
    from ..index import upgrade

    url = args.index or default_index_url(find_store(args.store))
    revision = upgrade(url)
    if args.json:
        emit_json({"index": url, "revision": revision})
    else:
        print(f"index {url} is at schema revision {revision}")
    return EXIT_OK
