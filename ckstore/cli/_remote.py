"""The remote commands: ``remote add|list|rm``, ``push``, ``pull`` and ``clone``.

Each command is one record (``cli/_command.py``) beside its handler. ``push``, ``pull`` and
``clone`` show a progress bar (bytes looked at) on a terminal, then their figures: snapshots,
chunks and bytes sent, and what the other side had already (``--json``: one document).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..engine.progress import ProgressFn
from . import _format as fmt
from ._args import STORE_HELP, storage_option_arg
from ._command import Command
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


REMOTE_ACTIONS = {
    "add": "add a remote: NAME URL [--index URL] [-o KEY=VALUE]",
    "list": "list the remotes and how many snapshots each holds (the default)",
    "rm": "forget a remote (the remote store is untouched)",
}


def _remote_arguments(p: argparse.ArgumentParser) -> None:
    """``remote add|list|rm``: their own ``--index`` and ``-o`` describe the remote, not the store."""
    sub = p.add_subparsers(dest="remote_command", metavar="ACTION", parser_class=type(p))
    for action, help_ in REMOTE_ACTIONS.items():
        sp = sub.add_parser(action, help=help_, description=help_[0].upper() + help_[1:] + ".")
        for flag, kw in (
            ("--store", {"metavar": "URL", "help": STORE_HELP}),
            ("--json", {"action": "store_true", "help": "print machine-readable JSON"}),
            ("--read-only", {"action": "store_true", "help": argparse.SUPPRESS}),
        ):
            sp.add_argument(flag, default=argparse.SUPPRESS, **kw)  # type: ignore[arg-type]
        if action in ("add", "rm"):
            sp.add_argument("name", help="the remote's name, e.g. origin")
        if action == "add":
            sp.add_argument(
                "url", help="the remote store's URL: a folder, s3://bucket/prefix, any fsspec URL"
            )
            sp.add_argument(
                "--index",
                dest="remote_index",
                metavar="URL",
                help="the remote's index URL (needed for S3: postgresql+psycopg://...)",
            )
            sp.add_argument(
                "--storage-option",
                "-o",
                dest="remote_option",
                action="append",
                type=storage_option_arg,
                metavar="KEY=VALUE",
                help="the remote's fsspec storage options (repeatable, as --storage-option); "
                "credentials are refused (kept in plain text): pass them in the environment",
            )
        sp.set_defaults(parser=sp)


REMOTE = Command(
    "remote",
    "add, list or remove remotes (other stores to push to and pull from)",
    (
        "ckstore remote add origin /mnt/shared/ckpts",
        "ckstore remote add tier s3://bucket/ckpts --index postgresql+psycopg://u@h/db -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
        "ckstore remote list",
        "ckstore remote rm origin",
    ),
    cmd_remote,
    _remote_arguments,
    description=(
        "Manage the store's remotes, kept in its index as git keeps them in its config: add NAME URL "
        "[--index URL] [-o KEY=VALUE] (the remote's own index and storage options, never credentials: "
        "those come from the environment, e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), list, rm "
        "NAME. A remote is any store ckstore opens: a folder, or s3://bucket/prefix with its index; "
        "the id of the store there is recorded and checked on every push and pull."
    ),
    completes=("remote-action", "remote"),
)


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


def _transfer_arguments(name: str) -> Callable[[argparse.ArgumentParser], None]:
    """The arguments of ``push`` or ``pull`` (``name``)."""

    def add(p: argparse.ArgumentParser) -> None:
        there = "the remote" if name == "push" else "this store"
        p.add_argument("remote", help="the remote's name (`ckstore remote list`)")
        p.add_argument(
            "refs",
            nargs="*",
            metavar="REF",
            help=f"what to {'send' if name == 'push' else 'bring'}: a tag (its snapshot and the tag), a run (all "
            f"of it), run@step, a name or an id{' there' if name == 'pull' else ''} (default: every run and tag)",
        )
        p.add_argument(
            "--force", "-f", action="store_true", help=f"move tags {there} holds at other snapshots"
        )

    return add


PUSH = Command(
    "push",
    "send snapshots and their missing chunks to a remote",
    (
        "ckstore push origin",
        "ckstore push origin sft",
        "ckstore push origin best --force",
        "ckstore push origin --json",
    ),
    cmd_push,
    _transfer_arguments("push"),
    description=(
        "Send snapshots to a remote: those REFs name (a tag: its snapshot and the tag; a run: all of it; "
        "run@step, a name or an id: that snapshot), or every run and tag. Only the chunks the remote lacks "
        "are sent; each snapshot becomes visible there in one commit once all its chunks are there, and an "
        "interrupted push resumes without sending again what arrived. The remote store is created if there "
        "is none and the remote was never used; a used remote whose store is missing is never made anew "
        "(exit 3), another store at its URL is refused (exit 4). A tag the remote holds at another snapshot "
        "is moved only with --force (exit 4 otherwise). "
        "A progress bar (stored bytes) on a terminal; --json prints the figures: snapshots, chunks and bytes "
        "sent and skipped."
    ),
    completes=("remote", "ref*"),
)


def cmd_pull(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.pull(args.remote, args.refs, force=args.force, progress=_bar(args))
    _print(report.to_dict(), args.json)
    return EXIT_OK


PULL = Command(
    "pull",
    "bring snapshots and their missing chunks from a remote",
    (
        "ckstore pull origin",
        "ckstore pull origin base-model",
        "ckstore pull origin sft@1200 --json",
    ),
    cmd_pull,
    _transfer_arguments("pull"),
    description=(
        "Bring snapshots of a remote here: those REFs name there, or every run and tag. Every payload is "
        "decoded and hashed against its chunk id before it is stored (a digest the remote supplies proves "
        "nothing): a damaged chunk of the remote is named (exit 5) and the snapshots that need it are not "
        "committed here; the others are. Progress and --json as for push."
    ),
    completes=("remote", "ref*"),
)


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


def _clone_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "url", help="the store to copy (a folder, s3://bucket/prefix; its index with --index)"
    )
    p.add_argument("dest", help="where to make the new store (a new or empty folder)")
    p.add_argument(
        "--dest-index",
        metavar="URL",
        help="the new store's index (default: SQLite inside DEST)",
    )


CLONE = Command(
    "clone",
    "make a new store holding everything of another",
    (
        "ckstore clone /mnt/shared/ckpts ./ckpts",
        "ckstore clone s3://bucket/ckpts ./ckpts --index postgresql+psycopg://u@h/db -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
    ),
    cmd_clone,
    _clone_arguments,
    description=(
        "Make a new store at DEST holding every run, snapshot and tag of the store at URL (verified on the "
        "way), with the same chunk, pack and inline sizes, and URL as its remote `origin`. --index and -o "
        "describe the store at URL; --dest-index the new one (default: SQLite inside DEST). A progress bar "
        "on a terminal, as for pull."
    ),
    completes=("file", "file"),
)


def _print(d: dict[str, Any], as_json: bool) -> None:
    if not as_json and "bytes_per_second" in d:
        d = {**d, "bytes_per_second": f"{fmt.size(d['bytes_per_second'])}/s"}
    print_report(d, as_json)


def _bar(args: argparse.Namespace) -> ProgressFn | None:
    """Bars over the stored bytes sent or found at the other side, on a terminal (none with
    ``--json``, whose figures say it all)."""
    return None if args.json else fmt.bar()
