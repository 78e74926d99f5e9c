"""What every command shares: exit codes, finding and opening the store, and output.

Output is JSON for scripts (``emit_json``) or ``key: value`` lines for people (``print_report``);
errors become exit codes (``exit_code``) or one-line usage errors (``usage_error``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import (
    CONFLICT,
    CORRUPTION,
    NOT_FOUND,
    OTHER_ERROR,
    USAGE,
    CkstoreError,
    InvalidInputError,
    NotFoundError,
    kind_of,
)
from . import _format as fmt

if TYPE_CHECKING:
    from ..store import Store

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""``check`` (or ``verify``, ``reindex``) ran and found problems."""
# the error kinds' codes, from the one table (``ckstore.errors.ERROR_KINDS``)
EXIT_USAGE = USAGE.exit_code
EXIT_NOT_FOUND = NOT_FOUND.exit_code
EXIT_CONFLICT = CONFLICT.exit_code
EXIT_CORRUPT = CORRUPTION.exit_code
EXIT_ERROR = OTHER_ERROR.exit_code
STORE_ENV = "CKSTORE_STORE"
CONFIG_NAME = "ckstore.json"


# --- finding and opening the store ------------------------------------------------------------
def find_store(explicit: str | None, cwd: str | None = None) -> str:
    """``--store``, then ``$CKSTORE_STORE``, then the nearest directory upwards with ckstore.json.

    Raises:
        NotFoundError: None of them names a store. The message says where it looked, how to
            point at a store, and names the store in a direct subfolder if there is one.
    """
    if explicit:
        return explicit
    if os.environ.get(STORE_ENV):
        return os.environ[STORE_ENV]
    here = os.path.abspath(cwd or os.getcwd())
    d = here
    while True:
        if os.path.isfile(os.path.join(d, CONFIG_NAME)):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    raise NotFoundError(
        f"no ckstore store found: no --store given, ${STORE_ENV} is not set, and neither "
        f"{here} nor any folder above it holds {CONFIG_NAME}.{_store_below(here)} Point at a "
        f"store with --store URL or {STORE_ENV}=URL, or create one with `ckstore init [PATH]`"
    )


def _store_below(here: str) -> str:
    """A hint naming the store in a direct subfolder of ``here``, if there is exactly one."""
    try:
        below = [
            e.name
            for e in os.scandir(here)
            if e.is_dir() and os.path.isfile(os.path.join(e.path, CONFIG_NAME))
        ]
    except OSError:
        return ""
    if len(below) != 1:
        return ""
    return f" The folder {below[0]}/ here holds a store: pass --store {below[0]} (or cd into it)."


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fsspec ``storage_options`` that the ``--storage-option KEY=VALUE`` options build.

    Dots in KEY nest (``client_kwargs.endpoint_url=...`` becomes
    ``{"client_kwargs": {"endpoint_url": ...}}``); VALUE is parsed as JSON when it parses
    (``true``, ``10``, ``{"a": 1}``), else kept as a string.

    Raises:
        InvalidInputError: two options give a key both a value and nested keys.
    """
    out: dict[str, Any] = {}
    pairs = (getattr(args, "storage_option", None) or []) + (
        getattr(args, "storage_option_sub", None) or []
    )
    for path, value in pairs:
        node = out
        for i, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InvalidInputError(
                    f"--storage-option {'.'.join(path)}: {'.'.join(path[: i + 1])} already has "
                    "a value, so it cannot also have nested keys"
                )
        if isinstance(node.get(path[-1]), dict) and not isinstance(value, dict):
            raise InvalidInputError(
                f"--storage-option {'.'.join(path)}: it already has nested keys"
            )
        node[path[-1]] = value
    return out


def open_store(args: argparse.Namespace, **options: Any) -> Store:
    """Open the store the arguments name (see :func:`find_store`; it must exist).

    ``--storage-option`` values become ``storage_options``; ``options`` go to ``ckstore.open``.
    """
    import ckstore

    if getattr(args, "read_only", False):
        options.setdefault("read_only", True)
    return ckstore.open(
        find_store(args.store),
        index=args.index,
        storage_options=storage_options(args),
        create=False,
        **options,
    )


def check_runs(store: Store, runs: list[str] | None) -> None:
    """Refuse a ``--run`` that names no run of ``store``, as ``log --run`` does (exit 3).

    Raises:
        NotFoundError: a run has no snapshot; the message names the closest runs and lists
            the store's runs (the first ten and how many more).
    """
    known = store.runs()
    for run in runs or ():
        if run in known:
            continue
        near = difflib.get_close_matches(run, known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
        shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
        raise NotFoundError(f"no run {run!r} in store {store.url}: {hint}runs: {shown or '(none)'}")


# --- output -------------------------------------------------------------------------------------
def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def print_report(d: dict[str, Any], as_json: bool) -> None:
    """A report's ``to_dict()``: JSON, or ``key: value`` lines (sizes made human)."""
    if as_json:
        emit_json(d)
    else:
        print("\n".join(report_lines(d)))


def report_lines(d: dict[str, Any], indent: str = "") -> list[str]:
    """A report's ``key: value`` lines (nested dicts indented, sizes, durations and times made
    human), as :func:`print_report` prints them."""
    lines = []
    for key, value in d.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key}:"] + report_lines(value, indent + "  ")
        elif (
            isinstance(value, (list, tuple))
            and value
            and not all(isinstance(v, (int, float, str)) for v in value)
        ):
            lines.append(f"{indent}{key}: {len(value)}")
            lines += [f"{indent}  - {json.dumps(v, default=str)}" for v in value[:50]]
        elif isinstance(value, (list, tuple)):
            more = f", ... {len(value) - 10} more" if len(value) > 10 else ""
            lines.append(
                f"{indent}{key}: {len(value)}"
                + (f" ({', '.join(str(v) for v in value[:10])}{more})" if value else "")
            )
        elif "bytes" in key and isinstance(value, int):
            lines.append(f"{indent}{key}: {fmt.size(value)}")
        elif key.endswith("_seconds") and isinstance(value, (int, float)):
            lines.append(f"{indent}{key}: {fmt.duration(value)}")
        elif key.endswith("_at") and isinstance(value, (int, float, type(None))):
            lines.append(f"{indent}{key}: {fmt.when(value)}")
        else:
            lines.append(f"{indent}{key}: {fmt.cell(value)}")
    return lines


# --- confirmation -------------------------------------------------------------------------------
def is_terminal() -> bool:
    """True when a person can answer a question (stdin and stderr are terminals)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def ask(question: str) -> bool:
    """Ask ``question`` on the terminal; True only for an explicit yes."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def confirmed(args: argparse.Namespace, question: str) -> bool:
    """Whether a destructive step may go ahead: ``--yes``, no terminal to ask (a script, which
    asked for it in its arguments), or a person answering yes on the terminal."""
    if getattr(args, "yes", False) or not is_terminal():
        return True
    return ask(question)


# --- errors -------------------------------------------------------------------------------------
def report_error(message: str, code: int, kind: str, as_json: bool) -> int:
    """Print an error as one line on stderr and, under ``--json``, also as one JSON document on
    stdout: ``{"error": {"type": ..., "message": ..., "exit_code": ...}}``. Returns ``code``."""
    message = " ".join(message.split()) or kind
    if as_json:
        emit_json({"error": {"type": kind, "message": message, "exit_code": code}})
    print(f"ckstore: error: {message}", file=sys.stderr)
    return code


def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    parser: argparse.ArgumentParser = args.parser
    parser.error(message)


def exit_code(exc: CkstoreError) -> int:
    """The process exit code for a ckstore error: its kind's (``ckstore.errors.ERROR_KINDS``)."""
    return kind_of(exc).exit_code
