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
from collections.abc import Sequence

from .. import __version__
from ..engine.lease import Terminated
from ..errors import CkstoreError
from . import _complete
from ._args import Parser, common_options
from ._cat import CAT
from ._command import Command, Handler
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
from ._complete import COMPLETION
from ._diff import DIFF
from ._folders import MARK_FOLDER, SYNC_FOLDER
from ._interop import EXPORT, IMPORT
from ._log import LOG, LS, SHOW
from ._maintenance import CHECK, COMPACT, DU, GC, MIGRATE, REINDEX, gc_policy
from ._refs import RM, TAG
from ._remote import CLONE, PULL, PUSH, REMOTE
from ._repair import REPAIR
from ._setup import DEMO, INIT
from ._ui import UI
from ._verify import VERIFY

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
    "Command",
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

DEBUG_ENV = "CKSTORE_DEBUG"
"""Set to 1 to let an unexpected error (a bug) end in its traceback instead of one line."""

COMMANDS: tuple[Command, ...] = (
    INIT, LOG, SHOW, LS, CAT, DIFF, TAG, RM, GC, COMPACT, CHECK, REPAIR, DU, IMPORT, EXPORT, VERIFY,
    REMOTE, PUSH, PULL, CLONE, MARK_FOLDER, SYNC_FOLDER, REINDEX, MIGRATE, UI, COMPLETION, DEMO,
)  # fmt: skip
"""Every command, in the order ``ckstore --help`` lists them; each record lives beside its
handler (``cli/_command.py``)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ckstore``: the common options, and one subparser per record of
    :data:`COMMANDS`."""
    p = Parser(
        prog="ckstore",
        parents=[common_options(False)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Content-addressed, versioned, deduplicating checkpoint store for PyTorch.",
        epilog=textwrap.dedent((__doc__ or "\n\n").split("\n\n", 1)[1])
        + "\nexamples:\n  ckstore init ./ckpts\n  ckstore log --run sft\n"
        "  ckstore diff sft@100 best --numeric\n  ckstore gc --keep-last 3 --dry-run",
    )
    p.add_argument("--version", action="version", version=f"ckstore {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_to(sub, main)
    return p


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
