"""The knobs: settings of one process's handle on a store, each written once, as a row of
:class:`Knobs`.

A knob is read and set as an attribute (``store.threads = 8``, ``repo.delta_depth``); it
affects this process only and is never stored. A row gives its kind (what values it takes,
checked on every set), its environment variable (read when the store is opened), its default
(when the variable is unset or empty) and its doc. :class:`Knobs` is the table and the base of
what carries knobs: the :class:`~ckstore.engine.repository.Repository`, and the public
:class:`ckstore.Store`, which shares its repository's values. A new knob is one row here.

:data:`STORE_DEFAULT` is the value of a take option left to the knob of the same name.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

from ..errors import InvalidInputError
from ..format.limits import INT64_MAX, check_int, check_number
from .background import idle_cores
from .config import (
    DEFAULT_DELTA_DEPTH,
    DEFAULT_LEASE_SECONDS,
    MAX_DELTA_DEPTH,
    MAX_LEASE_SECONDS,
    MAX_THREADS,
    TAKE_CODECS,
    check_delta_base,
)

T = TypeVar("T")
S = TypeVar("S")


class StoreDefault(enum.Enum):
    """The type of :data:`STORE_DEFAULT` (one member, so type checkers narrow ``is`` tests)."""

    STORE_DEFAULT = "STORE_DEFAULT"

    def __repr__(self) -> str:
        return "ckstore.STORE_DEFAULT"

    __str__ = __repr__


STORE_DEFAULT = StoreDefault.STORE_DEFAULT
"""A take option left to the store's knob of the same name: ``delta_base=STORE_DEFAULT`` (the
default of :meth:`ckstore.Store.take`) takes ``store.delta_base``."""


class Kind(Generic[S]):
    """What values a knob takes: the check of a value set, and of its environment variable."""

    def check(self, name: str, value: Any) -> S:
        """``value`` set as knob ``name``, checked.

        Raises:
            InvalidInputError: a value this knob refuses; the message names ``name``.
        """
        raise NotImplementedError

    def parse(self, name: str, env: str, text: str) -> S:
        """The non-empty ``text`` of environment variable ``env`` as knob ``name``'s value
        (by default checked as if set).

        Raises:
            InvalidInputError: a value this knob refuses.
        """
        return self.check(name, text)

    def text(self, raw: str) -> str:
        """``raw``, an environment variable's text, as :meth:`parse` reads it (empty: unset)."""
        return raw


class Integer(Kind[int]):
    """An int in ``[lo, hi]`` (bools refused)."""

    def __init__(self, lo: int, hi: int = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, name: str, value: Any) -> int:
        return check_int(name, value, self.lo, self.hi)

    def parse(self, name: str, env: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise InvalidInputError(f"${env} must be an integer, got {text!r}") from None
        return check_int(f"${env}", value, self.lo, self.hi)


class Seconds(Kind[float]):
    """A finite number of seconds, > 0 and at most ``hi``."""

    def __init__(self, hi: float) -> None:
        self.hi = hi

    def check(self, name: str, value: Any) -> float:
        return check_number(name, value, 0.0, self.hi, lo_open=True)

    def parse(self, name: str, env: str, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise InvalidInputError(f"${env} must be a number of seconds, got {text!r}") from None
        return check_number(f"${env}", value, 0.0, self.hi, lo_open=True)


class Choice(Kind[str]):
    """One of a few names."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)

    def check(self, name: str, value: Any) -> str:
        if value not in self.choices:
            raise InvalidInputError(f"{name} must be one of {list(self.choices)}, got {value!r}")
        return str(value)


class Flag(Kind[bool]):
    """True or False; in the environment ``1``/``true``/``yes``/``on`` or their opposites."""

    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidInputError(f"{name} must be True or False, got {value!r}")
        return value

    def parse(self, name: str, env: str, text: str) -> bool:
        if text in ("0", "false", "no", "off"):
            return False
        if text in ("1", "true", "yes", "on"):
            return True
        raise InvalidInputError(f"${env} must be 1 or 0 (true/false), got {text!r}")

    def text(self, raw: str) -> str:
        return raw.strip().lower()


class Ref(Kind[str | None]):
    """None, ``"parent"`` or a snapshot ref (``config.check_delta_base``)."""

    def check(self, name: str, value: Any) -> str | None:
        return check_delta_base(value)


class OrNone(Kind[S | None]):
    """None (the knob's doc says what it means), or a value of ``kind``."""

    def __init__(self, kind: Kind[S]) -> None:
        self.kind = kind

    def check(self, name: str, value: Any) -> S | None:
        return None if value is None else self.kind.check(name, value)

    def parse(self, name: str, env: str, text: str) -> S | None:
        return self.kind.parse(name, env, text)

    def text(self, raw: str) -> str:
        return self.kind.text(raw)


class Knob(Generic[T, S]):
    """One knob, a row of :class:`Knobs`: a data descriptor read as ``T`` and set as ``S``.

    Read on a class it is itself (what ``inspect``, autodoc and editors read); read on an
    object, the object's value; set, the value as its kind checks it (InvalidInputError
    naming the knob).
    """

    def __init__(
        self,
        kind: Kind[S],
        doc: str,
        *,
        default: Callable[[], T],
        env: str | None = None,
        measured: bool = False,
    ) -> None:
        """Describe a knob.

        Args:
            kind: the values it takes (:class:`Integer`, :class:`Choice`, ...).
            doc: what it does, its range and its default (``help()``, docs/USAGE.md).
            default: its value where ``env`` is unset or empty.
            env: the environment variable read when a store is opened, if any.
            measured: the knob starts as None, which means "the default (``env`` included),
                worked out at each read": for a default that changes while a process runs.
        """
        self.kind, self.default, self.env, self.measured = kind, default, env, measured
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def initial(self) -> Any:
        """The value a handle starts with: None if measured, else :meth:`current`.

        Raises:
            InvalidInputError: the environment variable holds what this knob refuses (named).
        """
        return None if self.measured else self.current()

    def current(self) -> T | S:
        """The environment variable's value now, else the default."""
        text = self.kind.text(os.environ.get(self.env, "")) if self.env else ""
        return self.kind.parse(self.name, self.env or "", text) if text else self.default()

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Knob[T, S]: ...

    @overload
    def __get__(self, obj: Knobs, owner: type | None = None) -> T: ...

    def __get__(self, obj: Knobs | None, owner: type | None = None) -> Knob[T, S] | T:
        if obj is None:
            return self
        value: T = obj._knob_values[self.name]
        if value is None and self.measured:
            return self.current()  # type: ignore[return-value]
        return value

    def __set__(self, obj: Knobs, value: S) -> None:
        obj._knob_values[self.name] = self.kind.check(self.name, value)

    def __repr__(self) -> str:
        return f"<knob {self.name!r}>"


def _cpu_threads() -> int:
    return max(2, os.cpu_count() or 2)


def _half_available_memory() -> int:
    """Half of the RAM available now (``MemAvailable``, which counts page cache the kernel can
    drop: free memory alone shrinks to almost nothing once checkpoints have filled the cache)."""
    available = _mem_available()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 8 << 30
    return available // 2


def _mem_available() -> int | None:
    """Linux's estimate of memory available without swapping, or None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Knobs:
    """The knobs table, and the base of what carries knobs (a repository, a store).

    Each class attribute below is one knob (:class:`Knob`). Values belong to the object that
    was built without ``share``: a :class:`~ckstore.engine.repository.Repository` reads them
    from the environment when a store is opened; a :class:`ckstore.Store` shares its
    repository's, so setting one sets both.
    """

    threads: Knob[int, int] = Knob(
        Integer(1, MAX_THREADS),
        "Hash, encode and decode workers (1 to 1024; default ``$CKSTORE_THREADS`` or the CPU count).",
        env="CKSTORE_THREADS",
        default=_cpu_threads,
    )
    io_threads: Knob[int, int] = Knob(
        Integer(1, MAX_THREADS),
        "Packs a take writes at once (1 to 1024; default ``$CKSTORE_IO_THREADS`` or 4). Several "
        "writes in flight keep a disk busy through each pack's fsync (and S3 through each "
        "upload's latency); each holds up to one pack of encoded bytes in memory.",
        env="CKSTORE_IO_THREADS",
        default=lambda: 4,
    )
    background_threads: Knob[int, int | None] = Knob(
        OrNone(Integer(1, MAX_THREADS)),
        "Workers of the work that runs behind training: the part of an ``async_take`` that "
        "finishes in the background, and compaction (1 to 1024). They run at the lowest CPU "
        "priority (nice 19), so a trainer that wants a core gets it. Set explicitly, else "
        "``$CKSTORE_BACKGROUND_THREADS`` or the cores the machine left idle since the last "
        "async take (at least 1), measured at each read; None returns to that.",
        env="CKSTORE_BACKGROUND_THREADS",
        default=idle_cores,
        measured=True,
    )
    background_process: Knob[bool, bool] = Knob(
        Flag(),
        "Whether an ``async_take`` finishes in a helper process of the store handle, fed "
        "through shared memory, instead of a thread of this one, and the compaction after "
        "takes runs in another, so the training thread never waits for the GIL behind them "
        "(default False, or ``$CKSTORE_BACKGROUND_PROCESS``). Linux; for a store and index "
        "another process can open; takes need a state that fits the staging budget and no "
        "``progress`` callback (other takes, and compaction elsewhere, use threads).",
        env="CKSTORE_BACKGROUND_PROCESS",
        default=lambda: False,
    )
    stage_after_restore: Knob[bool, bool] = Knob(
        Flag(),
        "Whether a training job's restore (one that loads an optimizer's state) of a snapshot "
        "an ``async_take`` took readies, behind training, the staging memory of the next "
        "``async_take`` (as ``Store.prepare_staging``), so a "
        "restarted job's first checkpoint copies at memory speed instead of waiting for the "
        "kernel to zero new pages (default True, or ``$CKSTORE_STAGE_AFTER_RESTORE``). The "
        "memory, up to the staging budget, stays with the handle until an ``async_take`` uses "
        "it or the store closes.",
        env="CKSTORE_STAGE_AFTER_RESTORE",
        default=lambda: True,
    )
    memory_budget: Knob[int | None, int | None] = Knob(
        OrNone(Integer(0)),
        "Bytes a restore may stage (>= 0; default ``$CKSTORE_MEMORY_BUDGET``); None: a share "
        "of what each restore restores (``config.restore_budget``).",
        env="CKSTORE_MEMORY_BUDGET",
        default=lambda: None,
    )
    staging_budget: Knob[int, int | None] = Knob(
        OrNone(Integer(0)),
        "Bytes an ``async_take`` may copy (>= 0): set explicitly, else "
        "``$CKSTORE_STAGING_BUDGET`` or half the RAM available, measured at each read "
        "(available memory changes while training runs); None returns to that.",
        env="CKSTORE_STAGING_BUDGET",
        default=_half_available_memory,
        measured=True,
    )
    lease_seconds: Knob[float, float] = Knob(
        Seconds(MAX_LEASE_SECONDS),
        "How long a take's lease lasts between heartbeats (> 0, at most 7 days; default "
        "``$CKSTORE_LEASE_SECONDS`` or 600).",
        env="CKSTORE_LEASE_SECONDS",
        default=lambda: DEFAULT_LEASE_SECONDS,
    )
    delta_base: Knob[str | None, str | None] = Knob(
        Ref(),
        "What takes store deltas against unless they say otherwise: None (no deltas, the "
        'default), ``"parent"`` (the latest snapshot of the run) or a snapshot ref.',
        default=lambda: None,
    )
    delta_depth: Knob[int, int] = Knob(
        Integer(0, MAX_DELTA_DEPTH),
        "Longest delta chain a take builds (0 to 32; 0 stores every chunk whole; default "
        "``$CKSTORE_DELTA_DEPTH`` or 1). Reading a chunk decodes at most ``delta_depth + 1`` "
        "payloads.",
        env="CKSTORE_DELTA_DEPTH",
        default=lambda: DEFAULT_DELTA_DEPTH,
    )
    take_codec: Knob[str, str] = Knob(
        Choice(TAKE_CODECS),
        'How takes encode new whole chunks: ``"raw"`` (the default, or '
        "``$CKSTORE_TAKE_CODEC``: every chunk as it is, so a resume restores the newest "
        "snapshot at the speed of a copy; compaction rewrites older snapshots densely), "
        '``"fast"`` (``exp-zstd`` for floats, raw otherwise: 83% of raw on trained fp32 '
        'weights, also compacted later) or ``"dense"`` (``bytegroup-zstd``/``zstd`` at once).',
        env="CKSTORE_TAKE_CODEC",
        default=lambda: "raw",
    )
    direct_writes: Knob[str, str] = Knob(
        Choice(("background", "always", "never")),
        "Which takes write their packs around the page cache (``O_DIRECT``, on a local disk "
        'whose file system offers it): ``"background"`` (the default, or '
        "``$CKSTORE_DIRECT_WRITES``: the part of an ``async_take`` that finishes behind "
        "training, which then spends about a tenth of the CPU on writing and leaves the "
        'trainer\'s pages in the cache), ``"always"`` (every take: a synchronous one is '
        "faster too, but a restore right after it reads from the disk) or "
        '``"never"``.',
        env="CKSTORE_DIRECT_WRITES",
        default=lambda: "background",
    )
    auto_compact: Knob[bool, bool] = Knob(
        Flag(),
        "Whether takes of this process start a background compaction once older snapshots "
        "hold loose chunks (default True, or ``$CKSTORE_AUTO_COMPACT``: ``0``/``false``/"
        "``no``/``off`` turn it off).",
        env="CKSTORE_AUTO_COMPACT",
        default=lambda: True,
    )

    def __init__(self, share: Knobs | None = None) -> None:
        """Start with values from the environment, or with ``share``'s (the same values).

        Raises:
            InvalidInputError: an environment variable holds what its knob refuses (named).
        """
        self._knob_values: dict[str, Any] = (
            share._knob_values if share is not None else {k.name: k.initial() for k in table()}
        )


def table() -> Iterator[Knob[Any, Any]]:
    """Every knob, in the order of :class:`Knobs`."""
    for value in vars(Knobs).values():
        if isinstance(value, Knob):
            yield value
