"""The commands that change refs: ``tag`` creates, moves, lists and deletes tags; ``rm``
forgets snapshots or whole runs (``gc`` reclaims their bytes).

Each command is one record (``cli/_command.py``) beside its handler.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ..errors import ConflictError
from . import _format as fmt
from ._command import Command
from ._common import EXIT_OK, check_runs, confirmed, emit_json, open_store, usage_error
from ._log import snapshot_label, tags_by_snapshot

if TYPE_CHECKING:
    from ..store import Store


def cmd_tag(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        if args.delete:
            return _tag_delete(store, args)
        if args.ref is None:
            return _tag_list(store, args)
        if args.name is None:
            usage_error(args, "tag needs REF and NAME (or --list, or --delete NAME)")
        from ..index import validate_name

        validate_name(args.name, "tag")
        try:
            snap = store.tag(args.ref, args.name, force=args.force)
        except ConflictError as exc:
            raise ConflictError(str(exc).replace("pass force=True", "use --force")) from exc
    if args.json:
        emit_json({"tag": args.name, "snapshot_id": snap.id, "run": snap.run, "step": snap.step})
    else:
        print(f"tagged {snapshot_label(snap)} ({snap.id[:12]}) as {args.name}")
    return EXIT_OK


def _tag_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", nargs="?", help="snapshot to tag")
    p.add_argument("name", nargs="?", help="tag name")
    p.add_argument("--force", "-f", action="store_true", help="move the tag if it exists")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--list", "-l", action="store_true", help="list tags (the default without arguments)"
    )
    g.add_argument("--delete", "-d", metavar="NAME", help="delete a tag")


TAG = Command(
    "tag",
    "create, move, list or delete tags",
    (
        "ckstore tag sft@100 best",
        "ckstore tag sft best --force",
        "ckstore tag --list",
        "ckstore tag --delete best",
    ),
    cmd_tag,
    _tag_arguments,
    completes=("ref", "tag"),
)


def _tag_delete(store: Store, args: argparse.Namespace) -> int:
    store.untag(args.delete)
    if args.json:
        emit_json({"deleted": args.delete})
    else:
        print(f"deleted tag {args.delete}")
    return EXIT_OK


def _tag_list(store: Store, args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for t in store.tag_records():
        snap = store.get(t.snapshot_id)
        rows.append(
            {
                "name": t.name,
                "snapshot_id": t.snapshot_id,
                "run": snap.run,
                "step": snap.step,
                "version": t.version,
                "updated_at": t.updated_at,
                "where": snapshot_label(snap),
            }
        )
    if args.json:
        emit_json([{k: v for k, v in r.items() if k != "where"} for r in rows])
    elif rows:
        print(
            fmt.table(
                ("tag", "id", "snapshot", "moved"),
                [
                    (r["name"], r["snapshot_id"][:12], r["where"], fmt.when(r["updated_at"]))
                    for r in rows
                ],
            )
        )
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    if not args.refs and not args.runs:
        usage_error(args, "rm needs snapshots (REF ...) or --run NAME")
    if args.runs:
        if args.refs:
            usage_error(args, "give snapshots (REF ...) or --run NAME, not both")
        return _rm_runs(args)
    with open_store(args) as store:
        found = [store.get(ref) for ref in args.refs]  # resolve all before deleting any
        snaps = list({s.id: s for s in found}.values())  # two refs to one snapshot: once
        tags = tags_by_snapshot(store)
        tagged = [(s, sorted(tags[s.id])) for s in snaps if s.id in tags]
        if tagged and not args.force:  # refuse before deleting any
            which = "; ".join(
                f"{snapshot_label(s)} ({s.id[:12]}) is tagged {', '.join(t)}" for s, t in tagged
            )
            raise ConflictError(
                f"{which}: use --force to delete tagged snapshots with their tags, or remove "
                "the tags first (`ckstore tag --delete NAME`)"
            )
        for snap in snaps:
            try:
                store.delete(snap.id, force=args.force)
            except ConflictError as exc:  # tagged since the check above
                raise ConflictError(str(exc).replace("pass force=True", "use --force")) from exc
    if args.json:
        emit_json(
            {"deleted": [s.id for s in snaps], "tags_deleted": [n for _, t in tagged for n in t]}
        )
        return EXIT_OK
    for s in snaps:
        gone = tags.get(s.id)
        also = f" and its tags {', '.join(sorted(gone))}" if gone else ""
        print(f"deleted snapshot {snapshot_label(s)} ({s.id[:12]}){also}")
    print("run `ckstore gc` to reclaim the bytes no snapshot uses any more")
    return EXIT_OK


def _rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("refs", nargs="*", metavar="REF", help="snapshots to delete")
    p.add_argument(
        "--run",
        dest="runs",
        action="append",
        default=[],
        metavar="NAME",
        help="delete every snapshot of this run, and the run (repeatable; asks on a terminal)",
    )
    p.add_argument(
        "--force",
        "-f",
        action="store_true",
        help="also delete tagged snapshots, with their tags (refused otherwise)",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")


RM = Command(
    "rm",
    "delete snapshots or whole runs (gc reclaims their bytes)",
    (
        "ckstore rm sft@100",
        "ckstore rm sft@100 sft@200",
        "ckstore rm best --force",
        "ckstore rm --run old-sweep",
        "ckstore rm --run old-sweep --force --yes",
    ),
    cmd_rm,
    _rm_arguments,
    completes=("ref*",),
)


def _rm_runs(args: argparse.Namespace) -> int:
    """``rm --run NAME``: every snapshot of each run, one transaction per run."""
    args.runs = list(dict.fromkeys(args.runs))  # a run named twice: deleted once
    with open_store(args) as store:
        check_runs(store, args.runs)
        snaps = {run: store.log(run=run) for run in args.runs}
        tags = tags_by_snapshot(store)
        tagged = {
            run: sorted(n for s in found for n in tags.get(s.id, []))
            for run, found in snaps.items()
        }
        if any(tagged.values()) and not args.force:
            which = "; ".join(f"run {r} has tags {', '.join(t)}" for r, t in tagged.items() if t)
            raise ConflictError(
                f"{which}: use --force to delete tagged snapshots with their tags, or remove the "
                "tags first (`ckstore tag --delete NAME`)"
            )
        frees = store.exclusive_bytes()
        what = ", ".join(
            f"run {r} ({fmt.count(len(found), 'snapshot')}, {fmt.size(frees.get(r, 0))} only it uses"
            + (f"; tags {', '.join(tagged[r])}" if tagged[r] else "")
            + ")"
            for r, found in snaps.items()
        )
        if not confirmed(args, f"delete {what}?"):
            print("nothing deleted", file=sys.stderr)
            return EXIT_OK
        deleted = {run: store.delete_run(run, force=args.force) for run in args.runs}
    if args.json:
        emit_json({
            "runs": {r: [s.id for s in d] for r, d in deleted.items()},
            "tags_deleted": sorted(n for t in tagged.values() for n in t),
            "exclusive_bytes": {r: frees.get(r, 0) for r in deleted},
        })  # fmt: skip
        return EXIT_OK
    for run, gone in deleted.items():
        also = f" and their tags {', '.join(tagged[run])}" if tagged[run] else ""
        print(f"deleted run {run}: {fmt.count(len(gone), 'snapshot')}{also}")
    print(
        f"run `ckstore gc` to reclaim the {fmt.size(sum(frees.get(r, 0) for r in deleted))} no other run uses"
    )
    return EXIT_OK
