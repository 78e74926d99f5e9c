"""The argparse pieces: a parser with one-line usage errors, value types, and every option.

``common_options`` are the options every command takes; ``add_arguments`` adds one command's own.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NoReturn

from . import _format as fmt
from ._common import EXIT_USAGE, STORE_ENV, report_error


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as ONE line and exit code 2 (and, when the command
    line asks for ``--json``, as a JSON document on stdout too: see ``report_error``)."""

    json_errors = False
    """Set by ``main`` when the arguments hold ``--json`` (they are not parsed yet)."""

    def error(self, message: str) -> NoReturn:
        report_error(
            f"{message} (see `{self.prog} --help`)", EXIT_USAGE, "UsageError", self.json_errors
        )
        self.exit(EXIT_USAGE)


def _size_arg(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 4MiB, 512KiB, 1048576)"
        ) from None


def _duration_arg(text: str) -> float:
    try:
        return fmt.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(zero_ok: bool) -> Callable[[str], float]:
    """An argparse type for a fraction in (0, 1], or [0, 1] when ``zero_ok``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (0 <= value <= 1 and (zero_ok or value > 0)):
            raise argparse.ArgumentTypeError(
                f"fraction must be in {'[' if zero_ok else '('}0, 1], got {text!r}"
            )
        return value

    return parse


_fraction_arg = _fraction(zero_ok=False)
_unit_fraction = _fraction(zero_ok=True)


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _storage_option(text: str) -> tuple[list[str], Any]:
    """``a.b=VALUE`` -> ``(["a", "b"], VALUE parsed as JSON, else the string)``."""
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000), "
            f"got {text!r}"
        )
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return path, value


GC_GRACE_DEFAULT = "6h"
"""``history.gc.DEFAULT_GRACE_SECONDS`` as ``gc --help`` shows it (a test keeps them equal;
importing history here would load codecs for every command)."""
GC_REPACK_DEFAULT = 0.5
"""``history.gc.DEFAULT_REPACK_BELOW``, likewise."""

STORE_HELP = f"store URL (default: ${STORE_ENV}, then the nearest store upwards)"


def common_options(suppress: bool, store_help: str = STORE_HELP) -> argparse.ArgumentParser:
    """Options every command takes, before or after its name."""
    p = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("--store", metavar="URL", help=store_help, **kw)
    p.add_argument(
        "--index",
        metavar="URL",
        help="SQLAlchemy URL of the index (needed for remote stores)",
        **kw,
    )
    p.add_argument(
        "--storage-option",
        "-o",
        dest="storage_option_sub" if suppress else "storage_option",
        action="append",
        type=_storage_option,
        metavar="KEY=VALUE",
        help="an fsspec storage option for a remote store (repeatable; dots in KEY nest, "
        "VALUE is JSON or a string), e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000",
        **kw,
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON", **kw)
    p.add_argument(
        "--read-only",
        action="store_true",
        help="open the store without writing anything (automatic when it is not writable)",
        **kw,
    )
    return p


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
                type=_storage_option,
                metavar="KEY=VALUE",
                help="the remote's fsspec storage options (repeatable, as --storage-option); "
                "credentials are refused (kept in plain text): pass them in the environment",
            )
        sp.set_defaults(parser=sp)


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """Add the arguments and options of command ``name`` to its parser ``p``."""
    if name == "init":
        p.add_argument(
            "url",
            nargs="?",
            help="where to create it (default: --store, else the current directory)",
        )
        p.add_argument("--chunk-bytes", type=_size_arg, help="target chunk size (default 4MiB)")
        p.add_argument("--pack-bytes", type=_size_arg, help="target pack size (default 64MiB)")
        p.add_argument(
            "--inline-bytes",
            type=_size_arg,
            help="tensors up to this size live in the manifest (default 2KiB)",
        )
    elif name == "log":
        p.add_argument("--run", help="only this run")
        p.add_argument("-n", type=_nonneg_int, metavar="N", help="at most N snapshots")
        p.add_argument(
            "--healthy",
            action="store_true",
            help="only snapshots whose take found no NaN or Inf (those without a health record are left out)",
        )
    elif name == "show":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
    elif name == "ls":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
        p.add_argument("prefix", nargs="?", help="only keys starting with this")
    elif name == "cat":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
        p.add_argument("key", help="one entry's key, as `ckstore ls REF` lists them")
    elif name == "diff":
        p.add_argument("a", help="the old snapshot (a ref)")
        p.add_argument("b", help="the new snapshot (a ref)")
        p.add_argument(
            "--numeric",
            action="store_true",
            help="read changed chunks and report value differences",
        )
        p.add_argument("--all", action="store_true", help="also list unchanged keys")
    elif name == "tag":
        p.add_argument("ref", nargs="?", help="snapshot to tag")
        p.add_argument("name", nargs="?", help="tag name")
        p.add_argument("--force", "-f", action="store_true", help="move the tag if it exists")
        g = p.add_mutually_exclusive_group()
        g.add_argument(
            "--list", "-l", action="store_true", help="list tags (the default without arguments)"
        )
        g.add_argument("--delete", "-d", metavar="NAME", help="delete a tag")
    elif name == "rm":
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
    elif name == "compact":
        p.add_argument(
            "--keep-loose",
            type=_nonneg_int,
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
    elif name == "gc":
        p.add_argument(
            "--keep-last",
            type=_nonneg_int,
            metavar="N",
            help="keep the newest N snapshots of each run (default: unset; gc drops snapshots only "
            "when --keep-last, --keep-every-steps or --older-than is given, and asks on a terminal "
            "before leaving a run with none, as --keep-last 0 does)",
        )
        p.add_argument(
            "--keep-every-steps",
            type=_nonneg_int,
            metavar="N",
            help="keep snapshots whose step is a multiple of N (default: off)",
        )
        p.add_argument(
            "--older-than",
            type=_duration_arg,
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
            help="each run's newest healthy snapshot (no NaN/Inf recorded; RUN@healthy) is not kept automatically",
        )
        p.add_argument(
            "--grace",
            type=_duration_arg,
            metavar="DURATION",
            help=f"leave unreferenced data younger than this (default: {GC_GRACE_DEFAULT}; 0s "
            "reclaims at once when no take or restore is running)",
        )
        p.add_argument(
            "--repack-below",
            type=_unit_fraction,
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
    elif name == "check":
        p.add_argument(
            "--read-data",
            nargs="?",
            const=True,
            default=False,
            type=_fraction_arg,
            metavar="FRACTION",
            help="also read packs whole: each must hash to its name and each chunk in it to its "
            "id (all packs, or this random fraction of them, at least one)",
        )
    elif name == "import":
        p.add_argument(
            "path", help="a .safetensors or torch.save file, a Hugging Face or DCP folder"
        )
        p.add_argument(
            "--run", default="default", help="run to add the snapshot to (default: default)"
        )
        p.add_argument("--step", type=_nonneg_int, help="the snapshot's step")
        p.add_argument(
            "--tag",
            dest="tags",
            action="append",
            default=[],
            metavar="T",
            help="tag it (repeatable)",
        )
        p.add_argument(
            "--move-tags",
            action="store_true",
            help="move a --tag that exists already (refused otherwise, as `ckstore tag` without --force)",
        )
        p.add_argument("--name", help="a unique snapshot name")
        p.add_argument(
            "--format",
            choices=("safetensors", "hf", "torch", "dcp"),
            help="the checkpoint's format (default: detected)",
        )
        p.add_argument(
            "--delta-base",
            metavar="REF",
            help="store changed tensors as deltas against this snapshot where smaller (e.g. the base "
            "model a fine-tune started from; 'parent': the run's latest snapshot)",
        )
        p.add_argument(
            "--no-verify",
            action="store_true",
            help="import even if the files do not match the ckstore digests they carry (checked by default)",
        )
        p.add_argument(
            "--on-nonfinite",
            choices=("warn", "raise", "ignore"),
            default="warn",
            help="a tensor holding NaN or Inf: warn and import (default), refuse, or say nothing",
        )
    elif name == "export":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
        p.add_argument("dir", help="directory to write (must be missing or empty, unless --force)")
        p.add_argument(
            "--format",
            choices=("safetensors", "hf", "torch", "dcp"),
            default="safetensors",
            help="safetensors/hf: Hugging Face folder (default); torch: one torch.save file; dcp: a DCP directory",
        )
        p.add_argument(
            "--keys",
            action="append",
            metavar="GLOB",
            help="only keys matching this glob, e.g. 'model/**' (repeatable)",
        )
        p.add_argument("--force", action="store_true", help="replace a non-empty directory")
        p.add_argument(
            "--shard-size",
            type=_size_arg,
            metavar="SIZE",
            help="largest safetensors shard (default 5e9 bytes, Hugging Face's 5GB; e.g. 2GiB)",
        )
    elif name == "verify":
        p.add_argument(
            "path", help="an exported file or folder (safetensors, torch, DCP, Hugging Face)"
        )
    elif name == "ui":
        p.add_argument(
            "--port", type=_nonneg_int, default=8765, help="port (default 8765; 0: any free port)"
        )
        p.add_argument(
            "--host",
            help="address to bind (default 127.0.0.1); any other than loopback prints a warning: "
            "whoever reaches it can read the store",
        )
        p.add_argument(
            "--token",
            help="the token changes need (default: $CKSTORE_UI_TOKEN, else a random one, printed)",
        )
        p.add_argument("--no-open", action="store_true", help="do not open a browser")
    elif name == "completion":
        p.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell to complete in")
    elif name == "remote":
        _remote_arguments(p)
    elif name in ("push", "pull"):
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
    elif name == "clone":
        p.add_argument(
            "url", help="the store to copy (a folder, s3://bucket/prefix; its index with --index)"
        )
        p.add_argument("dest", help="where to make the new store (a new or empty folder)")
        p.add_argument(
            "--dest-index",
            metavar="URL",
            help="the new store's index (default: SQLite inside DEST)",
        )
    elif name == "demo":
        p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
        p.add_argument(
            "--every",
            type=int,
            default=5,
            metavar="N",
            help="snapshot every N steps of the first half (default 5)",
        )
