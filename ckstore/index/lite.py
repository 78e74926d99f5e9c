"""The reads a resume makes, answered from a SQLite index with the standard library alone.

Importing SQLAlchemy costs a fresh process about 0.2 s (a quarter of the gap between a
resume from ckstore and one from ``torch.save`` on a 270 MiB state), plus the full garbage
collection its 19 k objects set off in a heap torch filled, plus their teardown at exit. A
restore asks the index four things: does the database hold this store at this code's schema,
which snapshot a ref names, where its chunks are, and which packs live on a remote.
:class:`LiteReads` answers exactly those from the store's own ``index.sqlite`` with
:mod:`sqlite3`, and :class:`~ckstore.index.Index` (SQLAlchemy) opens only when anything
else is asked (``engine/repository.py``).

Contract: every answer equals the full index's, or there is none. Whatever this module does
not settle for certain (a ref it does not resolve, an ambiguity, a row that does not decode,
any ``sqlite3`` error) returns :data:`UNSURE`, and the caller asks the full index, which
finds the same thing or raises the typed error with its message. Never writes: an index that
needs its schema created, its store id recorded or its revision checked by alembic is not
opened here (:meth:`LiteReads.open` returns None). Each call is one read transaction (a delta
chain is seen whole); the connection is used under a lock by any thread, and a process forked
from the one that opened it opens its own (with a new lock: a thread of the parent may have
held the old one at the fork).
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar
from urllib.parse import quote

from ckstore.index import _convert
from ckstore.index._batches import BATCH_SIZE, unique
from ckstore.index.forks import sqlite_work
from ckstore.index.records import ChunkRecord, SnapshotRecord

T = TypeVar("T")


class _Unsure:
    """The type of :data:`UNSURE`."""

    def __repr__(self) -> str:
        return "UNSURE"


UNSURE: Final = _Unsure()
"""What a read answers when only the full index can: ask it."""

HEAD_REVISION = "0008"
"""The newest revision in ``migrations/versions`` (a test checks it against alembic's head;
``schema`` uses this one): the schema these queries are written for. An index at any other
revision opens the full index, which says what to do."""

DEFAULT_BUSY_TIMEOUT_S = 60.0
"""How long a SQLite connection waits for a lock (``db.make_engine`` uses this one too)."""

MAX_STEP = 2**63 - 1
_INT = re.compile(r"[+-]?\d+")
_HEALTHY = "nonfinite = 0 AND coalesce(stale, 0) = 0 AND coalesce(diverged, 0) = 0"
"""``_sql.healthy()`` in SQL (a test compares both on the same rows)."""
_MAX_CHAIN_ROUNDS = 65
_DOUBT = (sqlite3.Error, ValueError, OverflowError)
"""What leaves an answer to the full index: a driver error, text that is not UTF-8 and rows
that do not decode (``_convert.RowError``; both ValueError), an integer past 64 bits."""


class LiteReads:
    """The hot reads of one SQLite index file; create it with :meth:`open`."""

    def __init__(self, path: str, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._con: sqlite3.Connection | None = self._connect()
        self._inherited: list[sqlite3.Connection] = []
        _ALL.add(self)

    @classmethod
    def open(
        cls, path: str, store_id: str, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S
    ) -> LiteReads | None:
        """The reads of the index file ``path`` of the store ``store_id``, or None where the
        full index must open it: no such file, a schema revision other than this code's, a
        store id not yet recorded or another store's, or any error (which the full open then
        reports)."""
        if not os.path.isfile(path):
            return None
        try:
            lite = cls(path, busy_timeout_s)
        except _DOUBT:
            return None
        try:
            with lite._transaction() as con:
                revision = con.execute("SELECT version_num FROM alembic_version").fetchall()
                stored = con.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchall()
        except _DOUBT:
            lite.close()
            return None
        if revision != [(HEAD_REVISION,)] or stored != [(store_id,)]:
            lite.close()
            return None
        return lite

    def _connect(self) -> sqlite3.Connection:
        uri = f"file:{quote(self.path, safe='/')}?mode=rw"  # never creates the file
        with sqlite_work():
            con = sqlite3.connect(
                uri, uri=True, timeout=self._busy_timeout_s, check_same_thread=False,
                isolation_level=None,
            )  # fmt: skip
            con.row_factory = _row
            con.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        return con

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, sqlite_work():
            if self._con is not None and self._pid != os.getpid():  # a forked child
                self._inherited.append(self._con)  # the parent's: never closed here
                self._con, self._pid = self._connect(), os.getpid()
            con = self._con
            if con is None:
                raise sqlite3.ProgrammingError("the lite index reads are closed")
            con.execute("BEGIN")
            try:
                yield con
            finally:
                con.execute("COMMIT")

    def _read(self, query: Callable[[sqlite3.Connection], T]) -> T | _Unsure:
        try:
            with self._transaction() as con:
                return query(con)
        except _DOUBT:
            return UNSURE

    def close(self) -> None:
        """Closes the connection (idempotent); later reads answer :data:`UNSURE`."""
        with self._lock:
            con, self._con = self._con, None
        if con is not None and self._pid == os.getpid():
            with sqlite_work():
                con.close()

    # ------------------------------------------------------------------ the reads
    def resolve(self, ref: str) -> SnapshotRecord | _Unsure:
        """The snapshot ``ref`` names (the rules of ``_resolve``), where the answer is sure:
        a ``run@step``, ``run@healthy``, tag, snapshot name, run name or whole id that
        matches. Everything else (display refs, id prefixes, misses, errors) is UNSURE."""
        if not isinstance(ref, str) or not ref or ref.endswith(")"):
            return UNSURE
        return self._read(lambda con: _resolve(con, ref))

    def chunk_locations(self, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord] | _Unsure:
        """``Reads.chunk_locations``: the known chunks among ``chunk_ids`` with the bases of
        their deltas, down to each chain's root, in one transaction."""
        wanted = unique(chunk_ids)
        return self._read(lambda con: _locations(con, wanted))

    def remote_pack_ids(self) -> dict[str, str] | _Unsure:
        """``Tiering.remote_pack_ids``: pack id -> remote, for every pack row of a remote."""
        query = "SELECT id, remote FROM packs WHERE remote IS NOT NULL"
        return self._read(lambda con: {str(i): str(r) for i, r in con.execute(query)})


def recorded_store_id(path: str) -> str | None:
    """The store id the SQLite index file ``path`` records, or None: no such file, not an
    index, unreadable. Read-only; never creates the file."""
    if not os.path.isfile(path):
        return None
    try:
        with sqlite_work():
            con = sqlite3.connect(f"file:{quote(path, safe='/')}?mode=ro", uri=True)
            try:
                rows = con.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchall()
            finally:
                con.close()
    except _DOUBT:
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


_ALL: weakref.WeakSet[LiteReads] = weakref.WeakSet()
"""Every instance of this process, whose locks a forked child makes anew."""


def _after_fork_in_child() -> None:
    """A thread of the parent may have held a lock at the fork: it is not in the child."""
    for lite in list(_ALL):
        lite._lock = threading.Lock()  # noqa: SLF001 - the class's own fork hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_FIELDS: dict[tuple[str, ...], Any] = {}


def _row(cursor: sqlite3.Cursor, values: tuple[Any, ...]) -> Any:
    """Rows with attribute access, as ``_convert`` reads them."""
    names = tuple(d[0] for d in cursor.description)
    kind = _FIELDS.get(names)
    if kind is None:
        kind = _FIELDS[names] = namedtuple("Row", names, rename=True)
    return kind(*values)


def _latest(con: sqlite3.Connection, where: str, *args: Any) -> Any:
    return con.execute(
        f"SELECT * FROM snapshots WHERE {where} ORDER BY seq DESC LIMIT 1", args
    ).fetchone()


def _resolve(con: sqlite3.Connection, ref: str) -> SnapshotRecord | _Unsure:
    row = _resolve_row(con, ref)
    return UNSURE if row is None else _convert.snapshot(row)


def _resolve_row(con: sqlite3.Connection, ref: str) -> Any:
    """The ``snapshots`` row, or None where ``_resolve.resolve`` must decide."""
    if "@" in ref:
        run, _, step_text = ref.rpartition("@")
        if not run:
            return None
        if step_text == "healthy":
            return _latest(con, f"run = ? AND {_HEALTHY}", run)
        if not _INT.fullmatch(step_text) or not 0 <= int(step_text) <= MAX_STEP:
            return None
        return _latest(con, "run = ? AND step = ?", run, int(step_text))
    whole = con.execute("SELECT * FROM snapshots WHERE id = ?", (ref,)).fetchone()
    if whole is not None:  # a whole id first, as _resolve.resolve
        return whole
    tagged = con.execute("SELECT snapshot_id FROM tags WHERE name = ?", (ref,)).fetchone()
    if tagged is not None:
        latest = _latest(con, "run = ?", ref)
        if latest is not None and latest.id != tagged.snapshot_id:
            return None  # a tag and a run of one name: the full index names the ambiguity
        return con.execute("SELECT * FROM snapshots WHERE id = ?", (tagged.snapshot_id,)).fetchone()
    row = con.execute("SELECT * FROM snapshots WHERE name = ?", (ref,)).fetchone()
    if row is None:
        row = _latest(con, "run = ?", ref)
    return row


def _locations(con: sqlite3.Connection, todo: list[str]) -> dict[str, ChunkRecord]:
    found: dict[str, ChunkRecord] = {}
    for _ in range(_MAX_CHAIN_ROUNDS):
        for start in range(0, len(todo), BATCH_SIZE):
            batch = todo[start : start + BATCH_SIZE]
            marks = ",".join("?" * len(batch))
            rows = con.execute(f"SELECT * FROM chunks WHERE id IN ({marks})", batch)
            found.update((r.id, _convert.chunk(r)) for r in rows)
        todo = unique(
            r.base_id for r in found.values() if r.base_id is not None and r.base_id not in found
        )
        if not todo:
            break
    return found
