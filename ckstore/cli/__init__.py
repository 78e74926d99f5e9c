"""The ``ckstore`` command line (git-like subcommands).

Every command finds its store from `--store URL`, then `$CKSTORE_STORE`, then the nearest
directory upwards from the current one that holds `ckstore.json`. Read commands print aligned
tables for people and, with `--json`, one JSON document for scripts. A store that is not
writable (a read-only mount) opens read-only by itself: reads work, writes say why not.

Exit codes: 0 success, 1 `check` found problems, 2 usage error (bad arguments or names),
3 not found (ref, key, tag or store), 4 conflict (tag exists, store exists, lease lost),
5 corruption (damaged or missing stored data), 6 any other error (incl. a read-only store).
Every error is printed as one line, `ckstore: error: <message>`, on stderr; with --json,
stdout also gets one JSON document, {"error": {"type", "message", "exit_code"}}.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

from .. import __version__
from ..engine.lease import Terminated
from ..errors import CkstoreError
from . import _complete
from ._args import Parser, add_arguments, common_options
from ._cat import cmd_cat
from ._common import (
    CONFIG_NAME,
    EXIT_CONFLICT,
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    STORE_ENV,
    emit_json,
    exit_code,
    find_store,
    open_store,
    print_report,
    report_error,
    storage_options,
    usage_error,
)
from ._complete import cmd_completion
from ._history import cmd_diff, cmd_log, cmd_ls, cmd_rm, cmd_show, cmd_tag
from ._interop import cmd_export, cmd_import
from ._maintenance import (
    cmd_check,
    cmd_compact,
    cmd_du,
    cmd_gc,
    cmd_migrate,
    cmd_reindex,
    gc_policy,
)
from ._remote import cmd_clone, cmd_pull, cmd_push, cmd_remote
from ._setup import DEMO_STORE, cmd_demo, cmd_init
from ._ui import cmd_ui
from ._verify import cmd_verify

__all__ = [
    "COMMANDS",
    "CONFIG_NAME",
    "EXIT_CONFLICT",
    "EXIT_CORRUPT",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "STORE_ENV",
    "Handler",
    "Parser",
    "build_parser",
    "emit_json",
    "exit_code",
    "find_store",
    "gc_policy",
    "main",
    "open_store",
    "print_report",
    "storage_options",
    "usage_error",
]

DESCRIPTIONS = {
    "completion": _complete.DESCRIPTION,
    "demo": f"Train a small model, snapshot it, resume bit-exactly in a fresh process. The demo "
    f"makes its own store in {DEMO_STORE} (or --store FOLDER): it writes only into a new or "
    "empty folder, or replaces a store an earlier demo made; it never touches another store.",
    "verify": (
        "Check an exported file or folder against the BLAKE3 digests ckstore wrote with it (a "
        "safetensors file's own metadata, ckstore-digests.json beside the files). Needs no store; "
        "torch only to name the damaged tensor of a torch file. Exit 0 when everything matches, 5 "
        "when something does not (named), 1 when there is nothing to check against."
    ),
    "push": (
        "Send snapshots to a remote: those REFs name (a tag: its snapshot and the tag; a run: all of it; "
        "run@step, a name or an id: that snapshot), or every run and tag. Only the chunks the remote lacks "
        "are sent; each snapshot becomes visible there in one commit once all its chunks are there, and an "
        "interrupted push resumes without sending again what arrived. The remote store is created if there "
        "is none. A tag the remote holds at another snapshot is moved only with --force (exit 4 otherwise). "
        "A progress bar (stored bytes) on a terminal; --json prints the figures: snapshots, chunks and bytes "
        "sent and skipped."
    ),
    "pull": (
        "Bring snapshots of a remote here: those REFs name there, or every run and tag. Every payload is "
        "checked against its recorded digest (or decoded and hashed) before it is stored: a damaged chunk "
        "of the remote is named (exit 5) and its snapshot is not committed here. Progress and --json as "
        "for push."
    ),
    "clone": (
        "Make a new store at DEST holding every run, snapshot and tag of the store at URL (verified on the "
        "way), with the same chunk, pack and inline sizes, and URL as its remote `origin`. --index and -o "
        "describe the store at URL; --dest-index the new one (default: SQLite inside DEST). A progress bar "
        "on a terminal, as for pull."
    ),
    "remote": (
        "Manage the store's remotes, kept in its index as git keeps them in its config: add NAME URL "
        "[--index URL] [-o KEY=VALUE] (the remote's own index and storage options, never credentials: "
        "those come from the environment, e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), list, rm "
        "NAME. A remote is any store ckstore opens: a folder, or s3://bucket/prefix with its index; "
        "the id of the store there is recorded and checked on every push and pull."
    ),
    "ui": (
        "Serve a local web page of the store: runs and lineage, storage per snapshot, changes "
        "between two snapshots as a heat map over layers, recorded health, and a gc preview. It "
        "binds 127.0.0.1 unless --host says otherwise and prints its URL with a token; tagging and "
        "deleting from the page need that token."
    ),
}
STORE_HELPS = {
    "demo": f"folder for the demo's own store (default: {DEMO_STORE}; ${STORE_ENV} is not "
    "used); an existing store the demo did not make, or any other non-empty folder, is refused",
}

Handler = Callable[[argparse.Namespace], int]
DEBUG_ENV = "CKSTORE_DEBUG"
"""Set to 1 to let an unexpected error (a bug) end in its traceback instead of one line."""


COMMANDS: list[tuple[str, str, tuple[str, ...], Handler]] = [
    ("init", "create a store", (
        "ckstore init ./ckpts",
        "ckstore init ./ckpts --chunk-bytes 8MiB",
        "ckstore init s3://bucket/ckpts --index postgresql+psycopg://user@host/db",
    ), cmd_init),
    ("log", "list snapshots, newest first, with what their takes found (health)", (
        "ckstore log", "ckstore log --run sft -n 5", "ckstore log --run sft --healthy", "ckstore log --json",
    ), cmd_log),
    ("show", "show one snapshot: ids, metadata, stats, health", (
        "ckstore show sft", "ckstore show sft@100 --json", "ckstore show best", "ckstore show sft@healthy",
    ), cmd_show),
    ("ls", "list a snapshot's entries (kind, dtype, shape, bytes)", (
        "ckstore ls sft@100", "ckstore ls best model/ --json",
    ), cmd_ls),
    ("cat", "print one stored value, or a tensor's dtype, shape and value statistics", (
        "ckstore cat sft@100 progress/step",
        "ckstore cat best model/lm_head.weight",
        "ckstore cat sft optim/param_groups/0/lr --json",
    ), cmd_cat),
    ("diff", "compare two snapshots key by key", (
        "ckstore diff sft@100 sft@200",
        "ckstore diff base best --numeric",
        "ckstore diff sft@100 best --json",
    ), cmd_diff),
    ("tag", "create, move, list or delete tags", (
        "ckstore tag sft@100 best",
        "ckstore tag sft best --force",
        "ckstore tag --list",
        "ckstore tag --delete best",
    ), cmd_tag),
    ("rm", "delete snapshots or whole runs (gc reclaims their bytes)", (
        "ckstore rm sft@100", "ckstore rm sft@100 sft@200", "ckstore rm best --force",
        "ckstore rm --run old-sweep", "ckstore rm --run old-sweep --force --yes",
    ), cmd_rm),
    ("gc", "apply a retention policy and reclaim unreferenced data", (
        "ckstore gc --dry-run",
        "ckstore gc --keep-last 3 --older-than 7d",
        "ckstore gc --run sft --keep-every-steps 1000 --json",
        "ckstore gc --keep-last 0 --yes",
        "ckstore gc --keep-last 2 --no-keep-healthy",
    ), cmd_gc),
    ("compact", "rewrite older snapshots' loose chunks densely (deltas, full compression)", (
        "ckstore compact", "ckstore compact --dry-run --json", "ckstore compact --keep-loose 3",
    ), cmd_compact),
    ("check", "verify the store's integrity (exit 1 on problems)", (
        "ckstore check", "ckstore check --read-data", "ckstore check --read-data 0.1 --json",
    ), cmd_check),
    ("du", "disk usage per run: logical, stored, and what deleting the run frees", (
        "ckstore du", "ckstore du --json",
    ), cmd_du),
    ("import", "take a safetensors, Hugging Face, torch.save or DCP checkpoint into the store", (
        "ckstore import ./model.safetensors --run base --step 0",
        "ckstore import ./hf-model-folder --run base --tag llama-1b",
        "ckstore import ./ckpt.pt --run sft --step 1000 --format torch",
        "ckstore import ./dcp-checkpoint-dir --run titan --step 500",
        "ckstore import ./finetuned-folder --run sft --delta-base base",
    ), cmd_import),
    ("export", "write a snapshot as a Hugging Face folder, a torch.save file or a DCP directory", (
        "ckstore export best ./hf-out",
        "ckstore export sft@1000 ./weights --keys 'model/**' --shard-size 2GB",
        "ckstore export sft ./ckpt --format torch",
        "ckstore export sft ./dcp-out --format dcp --force",
    ), cmd_export),
    ("verify", "check an exported file or folder against its digests (no store needed)", (
        "ckstore verify ./hf-out", "ckstore verify ./hf-out/model.safetensors", "ckstore verify ./ckpt --json",
    ), cmd_verify),
    ("remote", "add, list or remove remotes (other stores to push to and pull from)", (
        "ckstore remote add origin /mnt/shared/ckpts",
        "ckstore remote add tier s3://bucket/ckpts --index postgresql+psycopg://u@h/db -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
        "ckstore remote list", "ckstore remote rm origin",
    ), cmd_remote),
    ("push", "send snapshots and their missing chunks to a remote", (
        "ckstore push origin", "ckstore push origin sft", "ckstore push origin best --force", "ckstore push origin --json",
    ), cmd_push),
    ("pull", "bring snapshots and their missing chunks from a remote", (
        "ckstore pull origin", "ckstore pull origin base-model", "ckstore pull origin sft@1200 --json",
    ), cmd_pull),
    ("clone", "make a new store holding everything of another", (
        "ckstore clone /mnt/shared/ckpts ./ckpts",
        "ckstore clone s3://bucket/ckpts ./ckpts --index postgresql+psycopg://u@h/db -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
    ), cmd_clone),
    ("reindex", "rebuild an empty index from the store's packs and manifests", (
        "ckstore reindex", "ckstore --store s3://bucket/ckpts --index postgresql+psycopg://u@h/new reindex",
    ), cmd_reindex),
    ("migrate", "upgrade the index schema to this ckstore's version", (
        "ckstore migrate", "ckstore migrate --index postgresql+psycopg://user@host/db",
    ), cmd_migrate),
    ("ui", "serve a local web view of runs, lineage, storage, changes and health", (
        "ckstore ui", "ckstore --store ./ckpts ui --port 0 --no-open",
        "CKSTORE_UI_TOKEN=secret ckstore ui --port 9000",
    ), cmd_ui),
    ("completion", "print a shell completion script (bash, zsh, fish)", (
        'eval "$(ckstore completion bash)"', 'eval "$(ckstore completion zsh)"',
        "ckstore completion fish | source",
    ), cmd_completion),
    ("demo", "train a small model, snapshot it, resume bit-exactly in a fresh process", (
        "ckstore demo", "ckstore --store ./my-demo demo --steps 20 --every 2",
    ), lambda args: cmd_demo(args, main)),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    fmt_cls = argparse.RawDescriptionHelpFormatter
    p = Parser(
        prog="ckstore",
        parents=[common_options(False)],
        formatter_class=fmt_cls,
        description="Content-addressed, versioned, deduplicating checkpoint store for PyTorch.",
        epilog=textwrap.dedent((__doc__ or "\n\n").split("\n\n", 1)[1])
        + "\nexamples:\n  ckstore init ./ckpts\n  ckstore log --run sft\n"
        "  ckstore diff sft@100 best --numeric\n  ckstore gc --keep-last 3 --dry-run",
    )
    p.add_argument("--version", action="version", version=f"ckstore {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, help_, examples, func in COMMANDS:
        sp = sub.add_parser(
            name,
            help=help_,
            description=textwrap.fill(DESCRIPTIONS.get(name, help_[0].upper() + help_[1:] + ".")),
            epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
            formatter_class=fmt_cls,
            parents=[common_options(True, **_store_help(name))],  # type: ignore[list-item]
        )
        add_arguments(name, sp)
        sp.set_defaults(func=func, parser=sp)
    return p


def _store_help(name: str) -> dict[str, str]:
    return {"store_help": STORE_HELPS[name]} if name in STORE_HELPS else {}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_complete.COMPLETE]:  # the shell asking for candidates (hidden)
        return _complete.main(argv[1:], build_parser())
    Parser.json_errors = "--json" in argv
    args = build_parser().parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    try:
        return int(args.func(args))
    except CkstoreError as exc:
        return report_error(str(exc), exit_code(exc), type(exc).__name__, as_json)
    except BrokenPipeError:  # e.g. `ckstore log | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return report_error(
            "interrupted (Ctrl-C): a take in progress committed nothing and released its lease",
            130, "KeyboardInterrupt", as_json,
        )  # fmt: skip
    except Terminated as exc:  # SIGTERM during a take (import): it unwound and ended its lease
        report_error(
            "terminated by SIGTERM: nothing was committed, and the take's lease was released "
            "(`ckstore gc` reclaims what it had written)",
            int(exc.code or 143), "Terminated", as_json,
        )  # fmt: skip
        return int(exc.code or 143)
    except OSError as exc:  # the file system said no (a path that is a file, no permission)
        where = f": {exc.filename}" if exc.filename else ""
        return report_error(
            f"{exc.strerror or exc}{where}", EXIT_ERROR, type(exc).__name__, as_json
        )
    except Exception as exc:  # a bug: one line, the traceback on request
        if os.environ.get(DEBUG_ENV):
            raise
        message = (
            f"internal error, please report it: {type(exc).__name__}: {exc} "
            f"(set {DEBUG_ENV}=1 to see the traceback)"
        )
        return report_error(message, EXIT_ERROR, type(exc).__name__, as_json)
