"""The maintenance commands: ``gc``, ``compact``, ``check``, ``du``, ``reindex`` and ``migrate``.

Each command is one record (``cli/_command.py``) beside its handler.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..errors import ReadOnlyStoreError
from . import _common
from . import _format as fmt
from ._args import duration_arg, fraction_arg, nonneg_int, unit_fraction
from ._command import Command
from ._common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    check_runs,
    emit_json,
    find_store,
    open_store,
    print_report,
)

GC_GRACE_DEFAULT = "6h"
"""``history.gc.DEFAULT_GRACE_SECONDS`` as ``gc --help`` shows it (a test keeps them equal;
importing history here would load codecs for every command)."""
GC_REPACK_DEFAULT = 0.5
"""``history.gc.DEFAULT_REPACK_BELOW``, likewise."""


# --- gc, check, reindex, du ---------------------------------------------------------------------
def gc_policy(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``store.gc`` that the options given ask for."""
    policy: dict[str, Any] = {
        "dry_run": args.dry_run,
        "keep_tagged": not args.no_keep_tagged,
        "keep_healthy": not args.no_keep_healthy,
    }
    for opt, key in (
        ("keep_last", "keep_last"),
        ("keep_every_steps", "keep_every_steps"),
        ("older_than", "older_than"),
        ("runs", "runs"),
        ("grace", "grace_seconds"),
        ("repack_below", "repack_below"),
        ("keep_best", "keep_best"),
        ("metric", "metric"),
        ("mode", "mode"),
    ):
        value = getattr(args, opt)
        if value is not None:
            policy[key] = value
    return policy


def cmd_gc(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        policy = gc_policy(args)
        check_runs(store, policy.get("runs"))
        if not args.dry_run and not args.yes and _common.is_terminal():
            emptied = runs_emptied(store, store.gc(**{**policy, "dry_run": True}).snapshots_dropped)
            if emptied and not _common.ask(
                f"gc would delete every snapshot of {', '.join(f'{r} ({n})' for r, n in emptied.items())}"
                " (no run keeps a snapshot unless --keep-last N >= 1, a tag or its newest healthy one, "
                "without --no-keep-healthy, keeps one). Go on?"
            ):
                print("nothing deleted", file=sys.stderr)
                return EXIT_OK
        report = store.gc(**policy, progress=fmt.bar())
    d = report.to_dict()
    if args.json:
        print_report(d, True)
        return EXIT_OK
    held = d.pop("sessions_held")
    print_report(d, False)
    if d.get("grace_kept_bytes"):
        print(_grace_note(d))
    if held:
        print(sessions_note(held, "gc leaves"))
    return EXIT_OK


def _gc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-last",
        type=nonneg_int,
        metavar="N",
        help="keep the newest N snapshots of each run (default: unset; gc drops snapshots only "
        "when --keep-last, --keep-every-steps, --keep-best or --older-than is given, and asks on a terminal "
        "before leaving a run with none, as --keep-last 0 does)",
    )
    p.add_argument(
        "--keep-every-steps",
        type=nonneg_int,
        metavar="N",
        help="keep snapshots whose step is a multiple of N (default: off)",
    )
    p.add_argument(
        "--keep-best",
        type=nonneg_int,
        metavar="N",
        help="keep the N best snapshots of each run by the metadata value --metric names (as "
        "Lightning's save_top_k); snapshots without it are not ranked (default: off)",
    )
    p.add_argument(
        "--metric",
        metavar="KEY",
        help="the metadata key --keep-best ranks by, e.g. loss (eval.loss reaches into a nested "
        "object)",
    )
    p.add_argument(
        "--mode",
        choices=("min", "max"),
        help="min: lower is better, as a loss (the default); max: higher is better",
    )
    p.add_argument(
        "--older-than",
        type=duration_arg,
        metavar="DURATION",
        help="only delete snapshots older than this (e.g. 7d, 12h; default: any age)",
    )
    p.add_argument(
        "--run",
        dest="runs",
        action="append",
        metavar="R",
        help="apply the policy to this run only (repeatable; default: every run)",
    )
    p.add_argument(
        "--no-keep-tagged",
        action="store_true",
        help="tagged snapshots are not kept automatically (default: a tag keeps its snapshot)",
    )
    p.add_argument(
        "--no-keep-healthy",
        action="store_true",
        help="each run's newest healthy snapshot (no NaN/Inf, stale tensor or diverged replica "
        "recorded; RUN@healthy) is not kept automatically",
    )
    p.add_argument(
        "--grace",
        type=duration_arg,
        metavar="DURATION",
        help=f"leave unreferenced data younger than this (default: {GC_GRACE_DEFAULT}; 0s "
        "reclaims at once when no take or restore is running)",
    )
    p.add_argument(
        "--repack-below",
        type=unit_fraction,
        metavar="FRACTION",
        help=f"rewrite packs whose live bytes fell below this fraction (default: "
        f"{GC_REPACK_DEFAULT}; 0 disables)",
    )
    p.add_argument(
        "--dry-run", "-n", action="store_true", help="say what would be deleted, delete nothing"
    )
    p.add_argument(
        "--yes",
        "-y",
        action="store_true",
        help="do not ask before deleting every snapshot of a run (asked on a terminal only)",
    )


GC = Command(
    "gc",
    "apply a retention policy and reclaim unreferenced data",
    (
        "ckstore gc --dry-run",
        "ckstore gc --keep-last 3 --older-than 7d",
        "ckstore gc --run sft --keep-every-steps 1000 --json",
        "ckstore gc --keep-last 0 --yes",
        "ckstore gc --keep-last 2 --no-keep-healthy",
        "ckstore gc --keep-best 3 --metric loss --keep-last 1",
    ),
    cmd_gc,
    _gc_arguments,
)


def cmd_compact(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        store.auto_compact = False
        bar = fmt.bar()
        raw = (
            store.compact(keep_loose=args.keep_loose, dry_run=True).raw_bytes
            if bar and not args.dry_run
            else 0
        )
        done = [0]

        def rewritten(n: int) -> None:
            done[0] += n
            assert bar is not None
            bar("compact", min(done[0], raw), raw)

        report = store.compact(
            keep_loose=args.keep_loose, dry_run=args.dry_run, progress=rewritten if raw else None
        )
        if bar is not None and raw:
            bar("compact", raw, raw)
    print_report(report.to_dict(), args.json)
    return EXIT_OK


def _compact_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-loose",
        type=nonneg_int,
        default=1,
        metavar="N",
        help="newest snapshots of each run whose chunks stay loose, in the fast form (default 1)",
    )
    p.add_argument(
        "--dry-run",
        "-n",
        action="store_true",
        help="say what would be rewritten, write nothing",
    )


COMPACT = Command(
    "compact",
    "rewrite older snapshots' loose chunks densely (deltas, full compression)",
    ("ckstore compact", "ckstore compact --dry-run --json", "ckstore compact --keep-loose 3"),
    cmd_compact,
    _compact_arguments,
)


def runs_emptied(store: Any, dropped: list[str]) -> dict[str, int]:
    """Run -> snapshots dropped, for the runs that ``dropped`` (gc's labels, ``run@step`` or
    ``run id``) would leave without any snapshot."""
    gone: dict[str, int] = {}
    for label in dropped:
        run = label.rpartition("@")[0] if "@" in label else label.split(" ")[0]
        gone[run] = gone.get(run, 0) + 1
    return {run: n for run, n in gone.items() if len(store.log(run=run)) <= n}


def sessions_note(held: list[dict[str, Any]], who: str) -> str:
    """Which write sessions hold data, whose, until when, and how to free it."""
    now = time.time()
    lines = [
        f"write sessions holding data ({len(held)}): a take in progress, or one killed before it ended its lease"
    ]
    for h in held:
        if h["expired"]:
            until = f"lease ran out {fmt.when(h['expires_at'])}: the next `ckstore gc` ends it"
        else:
            until = f"lease until {fmt.when(h['expires_at'])} (in {_left(h['expires_at'] - now)})"
        lines.append(
            f"  {h['owner']}  started {fmt.when(h['started_at'])}  {until}; "
            f"{fmt.count(h['pinned_chunks'], 'chunk')} pinned, {fmt.size(h['held_bytes'])} in no "
            "snapshot"
        )
    lines.append(
        f"{who} those bytes until the take commits or its lease ends (a take stopped by Ctrl-C "
        "or SIGTERM ends its lease at once; one killed with SIGKILL holds it until it runs out)"
    )
    return "\n".join(lines)


def _left(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


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
    if args.repair:  # `check --read-data --repair` is `repair`
        from ._repair import cmd_repair

        args.remote = None
        return cmd_repair(args)
    with open_store(args) as store:
        report = store.check(
            read_data=args.read_data, progress=lambda it: fmt.progress(it, "packs")
        )
    if args.json:
        print_report(report.to_dict(), True)
    else:
        print("\n".join(check_lines(report.to_dict())))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def check_lines(d: dict[str, Any]) -> list[str]:
    """``check``'s report for people: its ``key: value`` lines, each problem a sentence with
    the snapshots and keys it breaks (never raw JSON), and a note on what the counts count
    (three tools count chunks three ways: ``du`` the chunks snapshots reference, ``check``
    every chunk row of the index, a read of whole packs every entry it decodes)."""
    lines = []
    for key, value in d.items():
        if key == "problems":
            lines.append(f"problems: {len(value)}")
            lines += [f"  - {_problem(p)}" for p in value]
        else:
            lines += _common.report_lines({key: value})
    lines.append(
        "note: chunks counts every chunk the index records (those snapshots reference, the bases "
        "their deltas are stored against, any gc has yet to reclaim; `du` counts the referenced "
        "ones); chunks_read every chunk entry of the packs read (a delta's base is decoded "
        "again for each delta)"
    )
    return lines


def _problem(p: dict[str, Any]) -> str:
    """One problem as a sentence: what, which object, and what it breaks."""
    if not {"kind", "object", "message"} <= p.keys():  # another report's shape: its fields
        return ", ".join(f"{k} {v}" for k, v in p.items())
    users = []
    if p.get("snapshots"):
        users.append(f"breaks {', '.join(p['snapshots'][:5])}")
    if p.get("keys"):
        more = " ..." if len(p["keys"]) > 5 else ""
        users.append(f"keys {', '.join(p['keys'][:5])}{more}")
    return f"{p['kind']} {p['object'][:16]}: {p['message']}" + (
        f" ({'; '.join(users)})" if users else ""
    )


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--read-data",
        nargs="?",
        const=True,
        default=False,
        type=fraction_arg,
        metavar="FRACTION",
        help="also read packs whole: each must hash to its name and each chunk in it to its "
        "id (all packs, or this random fraction of them, at least one)",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="read every pack and heal each damaged chunk from a remote that holds it, as "
        "`ckstore repair` does (exit 1 if damage stays)",
    )


CHECK = Command(
    "check",
    "verify the store's integrity (exit 1 on problems)",
    (
        "ckstore check",
        "ckstore check --read-data",
        "ckstore check --read-data 0.1 --json",
        "ckstore check --read-data --repair",
    ),
    cmd_check,
    _check_arguments,
)


def cmd_reindex(args: argparse.Namespace) -> int:
    # the store must exist, its index need not: reindex rebuilds a fresh (or moved-aside) one
    with open_store(args, create_index=True) as store:
        report = store.reindex()
    print_report(report.to_dict(), args.json)
    return EXIT_OK if not report.skipped else EXIT_PROBLEMS


REINDEX = Command(
    "reindex",
    "rebuild an empty index from the store's packs and manifests",
    (
        "ckstore reindex",
        "ckstore --store s3://bucket/ckpts --index postgresql+psycopg://u@h/new reindex",
    ),
    cmd_reindex,
)


def cmd_du(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = store.du(progress=lambda it: fmt.progress(it, "packs"))
        held = [h.to_dict() for h in store.sessions()]
    if args.json:
        emit_json(
            {
                "runs": [r.to_dict() for r in rows[:-1]],
                "total": rows[-1].to_dict(),
                "sessions": held,
            }
        )
        return EXIT_OK
    table = [
        (
            r.run if r.run is not None else "(total)",
            r.snapshots,
            fmt.size(r.logical_bytes),
            fmt.size(r.stored_bytes),
            fmt.size(r.exclusive_bytes) if r.run is not None else "",
            r.chunks,
            fmt.ratio(r.dedup_ratio),
        )
        for r in rows
    ]
    print(
        fmt.table(
            ("run", "snapshots", "logical", "stored", "exclusive", "chunks", "ratio"),
            table,
            right=(1, 2, 3, 4, 5, 6),
        )
    )
    total = rows[-1]
    extra = total.unreferenced_bytes or 0
    print(
        f"packs on the backend: {total.packs}, {fmt.size(total.pack_bytes)}"
        + (
            f" ({fmt.size(extra)} beyond the chunks snapshots reference: the bases their "
            "deltas are stored against, pack headers, and chunks no snapshot uses, such as a "
            "cancelled or running take's, which gc reclaims after its grace period)"
            if extra > 64 * max(1, total.packs or 0)
            else ""
        )
    )
    if total.remote_bytes:
        print(
            f"at a remote only: {fmt.size(total.remote_bytes)} of the stored bytes (evicted from "
            "this disk; reading them fetches them from the remote, verified)"
        )
    if len(rows) > 1:
        print(
            "exclusive: stored bytes no other run uses, what `ckstore rm --run RUN` then `ckstore gc` free"
        )
    print(
        "chunks: those the snapshots reference, each once (`check` also counts the bases deltas "
        "are stored against and chunks gc has yet to reclaim)"
    )
    for r in rows if len(rows) > 2 else rows[:-1]:  # of one run, the store's line repeats it
        if r.delta_chunks:
            print(
                f"deltas in {r.run if r.run is not None else 'the store'}: "
                f"{fmt.count(r.delta_chunks, 'chunk')}, "
                f"{fmt.size(r.delta_raw_bytes)} raw stored in {fmt.size(r.delta_bytes)} "
                f"({fmt.size(r.delta_saved_bytes)} saved)"
            )
    if held:
        print(sessions_note(held, "gc keeps"))
    return EXIT_OK


DU = Command(
    "du",
    "disk usage per run: logical, stored, and what deleting the run frees",
    ("ckstore du", "ckstore du --json"),
    cmd_du,
)


# --- migrate ------------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> int:
    from ..engine.opening import default_index_url, read_only_reason
    from ..index import upgrade
    from ..index.db import is_read_only_url

    store = None if args.index else find_store(args.store)
    url = args.index or default_index_url(find_store(args.store))
    if getattr(args, "read_only", False):
        why: str | None = "--read-only was given"
    elif is_read_only_url(url):
        why = "its URL opens it read-only (mode=ro or immutable=1)"
    else:
        why = None if store is None else read_only_reason(store, url, None)
    if why is not None:
        raise ReadOnlyStoreError(
            f"cannot migrate the index {url}: migrating upgrades it in place, and {why}; "
            "run it without --read-only where the index is writable"
        )
    revision = upgrade(url)
    if args.json:
        emit_json({"index": url, "revision": revision})
    else:
        print(f"index {url} is at schema revision {revision}")
    return EXIT_OK


MIGRATE = Command(
    "migrate",
    "upgrade the index schema to this ckstore's version",
    ("ckstore migrate", "ckstore migrate --index postgresql+psycopg://user@host/db"),
    cmd_migrate,
)
