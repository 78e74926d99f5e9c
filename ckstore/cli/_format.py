"""Human output for the command line: sizes, durations, times, tables, optional progress bars."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def size(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "chunk")`` -> ``"1 chunk"``, ``count(3, "entry", "entries")`` ->
    ``"3 entries"``: a number and its noun, as English has them."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def parse_duration(text: str) -> float:
    """``"7d"`` -> 604800.0. Units: s, m, h, d, w (none: seconds).

    Raises:
        ValueError: The text is not a duration (argparse turns it into a usage error).
    """
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def duration(seconds: float) -> str:
    """``21600`` -> ``"6h"``: the largest unit that divides it (the inverse of parse_duration)."""
    for unit in ("w", "d", "h", "m"):
        n = seconds / _SECONDS[unit]
        if n >= 1 and n == int(n):
            return f"{int(n)}{unit}"
    return f"{seconds:g}s"


def when(ts: float | None) -> str:
    """Local time ``YYYY-MM-DD HH:MM:SS``."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain aligned table; columns whose index is in ``right`` are right-aligned."""
    body = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers))] + [line(r) for r in body])


def progress(items: Iterable[T], desc: str) -> Iterable[T]:
    """Wrap ``items`` in a tqdm bar when tqdm is installed and stderr is a terminal."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


def bar(label: str | None = None) -> Callable[[str, int, int], None] | None:
    """A progress callback (``fn(what, done, total)``, bytes) drawing one tqdm bar per ``what``
    on stderr when it is a terminal and tqdm is installed; None otherwise (no progress kept).
    ``label``: what the bars say instead of the engine's pass name (``import`` rather than the
    take it runs, ``export`` rather than the restore's read)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bars: dict[str, Any] = {}
    lock = threading.Lock()

    def told(what: str, done: int, total: int) -> None:
        with lock:
            b = bars.get(what)
            if b is None or b.total != total or done < b.n:  # a new pass of the same name
                if b is not None:
                    b.close()
                b = bars[what] = tqdm(
                    total=total,
                    desc=label if label and what in ("take", "restore") else what,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    leave=False,
                    file=sys.stderr,
                )
            b.update(done - b.n)
            if done >= total:
                bars.pop(what).close()

    return told
