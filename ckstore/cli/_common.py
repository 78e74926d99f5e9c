"""What every command shares: exit codes, finding and opening the store, and output.

Output is JSON for scripts (``emit_json``) or ``key: value`` lines for people (``print_report``);
errors become exit codes (``exit_code``) or one-line usage errors (``usage_error``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, NoReturn

from ..errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    ObjectNotFoundError,
)
from . import _format as fmt

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_CORRUPT, EXIT_ERROR = range(
    7
)
STORE_ENV = "CKSTORE_STORE"
CONFIG_NAME = "ckstore.json"


# --- finding and opening the store ------------------------------------------------------------
def find_store(explicit: str | None, cwd: str | None = None) -> str:
    """``--store``, then ``$CKSTORE_STORE``, then the nearest directory upwards with ckstore.json.

    Raises:
        NotFoundError: None of them names a store.
    """
    if explicit:
        return explicit
    if os.environ.get(STORE_ENV):
        return os.environ[STORE_ENV]
    d = os.path.abspath(cwd or os.getcwd())
    while True:
        if os.path.isfile(os.path.join(d, CONFIG_NAME)):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            raise NotFoundError(
                f"no ckstore store here or in any parent directory: pass --store URL, set "
                f"${STORE_ENV}, or create one with `ckstore init`"
            )
        d = parent


def open_store(args: argparse.Namespace, **options: Any) -> Any:
    """Open the store the arguments name (it must exist); ``options`` go to ``ckstore.open``."""
    import ckstore

    return ckstore.open(find_store(args.store), index=args.index, create=False, **options)


# --- output -------------------------------------------------------------------------------------
def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def print_report(d: dict[str, Any], as_json: bool) -> None:
    """A report's ``to_dict()``: JSON, or ``key: value`` lines (sizes made human)."""
    if as_json:
        emit_json(d)
    else:
        print("\n".join(_report_lines(d, "")))


def _report_lines(d: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for key, value in d.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key}:"] + _report_lines(value, indent + "  ")
        elif (
            isinstance(value, (list, tuple))
            and value
            and not all(isinstance(v, (int, float, str)) for v in value)
        ):
            lines.append(f"{indent}{key}: {len(value)}")
            lines += [f"{indent}  - {json.dumps(v, default=str)}" for v in value[:50]]
        elif isinstance(value, (list, tuple)):
            more = ", ..." if len(value) > 10 else ""
            lines.append(
                f"{indent}{key}: {len(value)}"
                + (f" ({', '.join(str(v)[:12] for v in value[:10])}{more})" if value else "")
            )
        elif "bytes" in key and isinstance(value, int):
            lines.append(f"{indent}{key}: {fmt.size(value)}")
        else:
            lines.append(f"{indent}{key}: {fmt.cell(value)}")
    return lines


# --- errors -------------------------------------------------------------------------------------
def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    parser: argparse.ArgumentParser = args.parser
    parser.error(message)


def exit_code(exc: CkstoreError) -> int:
    """The process exit code for a ckstore error."""
    if isinstance(exc, (CorruptionError, ObjectNotFoundError)):
        return EXIT_CORRUPT
    if isinstance(exc, NotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, ConflictError):
        return EXIT_CONFLICT
    if isinstance(exc, InvalidInputError):
        return EXIT_USAGE
    return EXIT_ERROR
