"""The argparse pieces every command shares: a parser with one-line usage errors, the value
types of options (sizes, durations, fractions, counts, storage options), and the options every
command takes (``common_options``). A command's own arguments are in its record, beside its
handler (``cli/_command.py``).
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


def size_arg(text: str) -> int:
    """An argparse type for a size: bytes, or with a unit (``4MiB``, ``512KiB``, ``2GB``)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 4MiB, 512KiB, 1048576)"
        ) from None


def duration_arg(text: str) -> float:
    """An argparse type for a duration in seconds (``7d``, ``12h``, ``0s``)."""
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


fraction_arg = _fraction(zero_ok=False)
"""An argparse type for a fraction in (0, 1]."""
unit_fraction = _fraction(zero_ok=True)
"""An argparse type for a fraction in [0, 1]."""


def nonneg_int(text: str) -> int:
    """An argparse type for an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def storage_option_arg(text: str) -> tuple[list[str], Any]:
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


STORE_HELP = f"store URL (default: ${STORE_ENV}, then the nearest store upwards)"
REF_HELP = "tag, run (its latest), run@step, snapshot name or id prefix"
"""What a REF argument may be (``store.get`` resolves it)."""


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
        type=storage_option_arg,
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
