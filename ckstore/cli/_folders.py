"""``ckstore mark-folder`` and ``ckstore sync-folder``: a trainer's plain DCP checkpoint folder
saved into a store (``ckstore.dcp.folder``), and its removed steps deleted from the store.

One record each (``cli/_command.py``) beside its handler. ``ckstore.dcp`` (torch's DCP) is
imported when a command runs, never by ``ckstore --help``.
"""

from __future__ import annotations

import argparse

from ._command import Command
from ._common import EXIT_OK, emit_json, find_store, open_store


def cmd_mark_folder(args: argparse.Namespace) -> int:
    from ..dcp import mark_folder

    marker = mark_folder(
        args.folder, find_store(args.store), args.run, index=args.index, replace=args.replace
    )
    if args.json:
        emit_json({"folder": marker.folder, "store": marker.store, "run": marker.run})
    else:
        print(f"marked {marker.folder}: dcp.save of <folder>/step-N goes to run {marker.run!r}")
        print(f"  of store {marker.store} (marker {marker.id[:12]}); start the trainer with")
        print("  python -m ckstore.dcp.launch -m <module> ... (torchrun -m ckstore.dcp.launch ...)")
    return EXIT_OK


def cmd_sync_folder(args: argparse.Namespace) -> int:
    from ..dcp import forget_removed
    from ..dcp.folder import read_marker

    marker = read_marker(args.folder)
    if marker is None:
        report = forget_removed(args.folder)  # reports why nothing was considered
    else:
        if args.store is None:
            args.store = marker.store
        if args.index is None:
            args.index = marker.index
        with open_store(args) as store:
            report = forget_removed(args.folder, store)
    if args.json:
        emit_json(
            {
                "folder": report.folder,
                "deleted": list(report.deleted),
                "kept_tagged": list(report.kept_tagged),
                "purged_now": report.purged_now,
                "paused": report.paused,
            }
        )
        return EXIT_OK
    if report.paused:
        print(f"nothing deleted: {report.paused}")
        return EXIT_OK
    print(f"deleted: {len(report.deleted)} snapshot(s) whose step folders were removed")
    print("\n".join(f"  - {sid[:16]}" for sid in report.deleted))
    if report.kept_tagged:
        print(f"kept (tagged): {len(report.kept_tagged)}")
        print("\n".join(f"  - {sid[:16]}" for sid in report.kept_tagged))
    print(f"chunks given back at once: {report.purged_now}")
    return EXIT_OK


def _mark_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="the trainer's checkpoint folder (created if missing)")
    p.add_argument("--run", default=None, help="the run of the saves (default: the folder's name)")
    p.add_argument(
        "--replace",
        action="store_true",
        help="re-mark a folder marked for another store or run (the old marker's snapshots stay "
        "in their store and are never deleted through this folder)",
    )


def _sync_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a folder marked with `ckstore mark-folder`")


MARK_FOLDER = Command(
    "mark-folder",
    "mark a trainer's DCP checkpoint folder so that its step-N saves go into the store",
    (
        "ckstore mark-folder ./outputs/checkpoint --store /ckpts --run llama3",
        "ckstore mark-folder ./ckpt --store s3://bucket/ckpts --run titan --replace",
    ),
    cmd_mark_folder,
    _mark_arguments,
    description=(
        "Write a small marker file (.ckstore-folder.step-0.json) into FOLDER. In a trainer started with "
        "`python -m ckstore.dcp.launch`, dcp.save of FOLDER/step-N is then one snapshot of RUN at "
        "step N, and FOLDER/step-N/.metadata a pointer to it (written after the snapshot "
        "commits); dcp.load of that path reads the snapshot; step folders the trainer removes "
        "are deleted from the store by its next save. Marking again with the same store and "
        "run changes nothing. The store is created by the first save if it does not exist."
    ),
    store_help="the store the saves go into (created by the first save if missing)",
    completes=("file",),
)

SYNC_FOLDER = Command(
    "sync-folder",
    "delete the snapshots whose step folders were removed from a marked folder",
    ("ckstore sync-folder ./outputs/checkpoint", "ckstore sync-folder ./ckpt --json"),
    cmd_sync_folder,
    _sync_arguments,
    description=(
        "What the next save into a marked folder does by itself: delete the snapshots saved "
        "through this folder's marker whose step folder is gone (or whose pointer a later save "
        "of the same step replaced), then gc, which gives their space back at once when no "
        "other write session is alive. Tagged snapshots are kept and listed. A folder that was "
        "moved or copied deletes nothing until marked again."
    ),
    store_help="the store (default: the one the folder's marker names)",
    completes=("file",),
)
