"""The base every part of the index builds on: one database, its transactions, read-only.

:class:`IndexBase` holds the engine (``db.make_engine``), opens it with its schema checked
(``schema.ensure_schema``), and gives its subclasses the two transactions every query runs in:

* ``_read(what)``: a read transaction (SQLite: a deferred ``BEGIN``, so readers never queue
  behind writers).
* ``_write(what)``: a write transaction (SQLite: ``BEGIN IMMEDIATE``, writers queue), refused
  with ReadOnlyStoreError on an index opened read-only.

Both translate database errors into ckstore errors naming ``what`` and the URL
(``_errors.translated``), and both hold the lock of an in-memory SQLite database, whose one
shared connection must not run two transactions at once. Each part of :class:`ckstore.index.Index`
(``sessions``, ``writes``, ``reads``, ``tags``, ...) is a subclass with one job; what the whole
promises is the contract in ``ckstore/index/index.py``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Self

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from ckstore.errors import IndexError_, ReadOnlyStoreError
from ckstore.index._errors import translated
from ckstore.index.db import (
    READONLY,
    display_url,
    is_memory_sqlite,
    is_read_only_url,
    make_engine,
    release_wal_files,
    sqlite_file,
    wal_files,
)
from ckstore.index.forks import sqlite_work
from ckstore.index.schema import ensure_schema


class IndexBase:
    """One index database and its transactions. Create it with :meth:`open`."""

    def __init__(
        self, engine: Engine, read_only: str | None = None, *, tidy: str | None = None
    ) -> None:
        """Wraps an engine whose schema is already checked; use :meth:`open` instead.

        ``read_only``: why the index is read-only (every write then raises
        ReadOnlyStoreError with this reason), or None for a writable one. ``tidy``: a SQLite
        file whose ``-wal`` / ``-shm`` did not exist before this index opened it read-only:
        :meth:`close` has SQLite remove them again.
        """
        self._engine = engine
        self._url = display_url(engine.url)
        self._read_only = read_only
        self._tidy = tidy
        # One shared connection (in-memory SQLite) must not run two transactions at once.
        shared = isinstance(engine.pool, StaticPool)
        self._lock: Any = threading.RLock() if shared else nullcontext()
        self._gate = _gate_for(engine)
        if not shared:
            _POOLED.add(self)

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, url: str, *, create: bool = True, read_only: str | bool | None = None) -> Self:
        """Opens (and, if ``create``, initializes) the index database at ``url``.

        Args:
            url: SQLAlchemy URL: ``sqlite:///path``, ``sqlite:///:memory:`` or
                ``postgresql+psycopg://user@host:port/db``.
            create: Give an empty database the schema (else NotFoundError).
            read_only: Open without writing anything, and refuse every write with
                ReadOnlyStoreError; a string says why (it ends that error's message). A
                SQLite URL with ``mode=ro`` or ``immutable=1`` is read-only by itself. A SQLite
                file that cannot be opened ``mode=ro`` (a WAL database on read-only media,
                where its ``-shm`` file cannot be made) is opened ``immutable=1``.

        Raises:
            SchemaError: If the database's schema is older or newer than this code, or it is
                not a ckstore index. The message says what to run.
            NotFoundError: If the database is empty and ``create`` is False.
            IndexError_: If the database cannot be reached.
        """
        if not read_only and is_read_only_url(url):
            read_only = "its URL opens it read-only (mode=ro or immutable=1)"
        reason = tidy = None
        if read_only:
            reason = read_only if isinstance(read_only, str) else "it was opened read-only"
            create = False
            path = sqlite_file(url)  # a mode=ro reader leaves -wal and -shm where it can
            tidy = path if path is not None and not wal_files(path) else None
        engine = make_engine(url, read_only=bool(reason))
        with _gate_for(engine)():
            try:
                engine = _checked(engine, url, create, reason)
            except BaseException:
                engine.dispose()
                if tidy is not None:
                    release_wal_files(tidy)
                raise
        return cls(engine, reason, tidy=tidy)

    @property
    def read_only(self) -> str | None:
        """Why this index refuses writes, or None when it is writable."""
        return self._read_only

    def close(self) -> None:
        """Closes every pooled connection. The index must not be used afterwards."""
        with self._gate():
            self._engine.dispose()
            if self._tidy is not None:
                release_wal_files(self._tidy)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._url

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._engine.dialect.name

    # -------------------------------------------------------------- transactions
    @contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        """A write transaction for ``what`` (refused on a read-only index)."""
        if self._read_only is not None:
            raise ReadOnlyStoreError(f"cannot {what}: {self._read_only}")
        with self._lock, translated(what, self._url), self._gate(), self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        """A read transaction for ``what``."""
        with self._lock, translated(what, self._url), self._gate(), self._engine.connect() as conn:
            conn.execution_options(**{READONLY: True})
            with conn.begin():
                yield conn


def _checked(engine: Engine, url: str, create: bool, reason: str | None) -> Engine:
    """``engine`` with its schema checked (or, read-only, an immutable one that works)."""
    try:
        with translated("open index", display_url(engine.url)):
            ensure_schema(engine, create=create)
        return engine
    except (IndexError_, ReadOnlyStoreError):  # SQLite's "readonly database": no -shm
        if reason is None or engine.dialect.name != "sqlite" or is_memory_sqlite(engine.url):
            raise
    engine.dispose()  # mode=ro could not open it: read-only media, try immutable
    engine = make_engine(url, read_only=True, immutable=True)
    with translated("open index", display_url(engine.url)):
        ensure_schema(engine, create=False)
    return engine


def _gate_for(engine: Engine) -> Callable[[], AbstractContextManager[None]]:
    """The fork gate of ``engine``'s work (``forks.py``): SQLite's, or none (a PostgreSQL
    client holds no process-wide lock a child would need, and waits on the server)."""
    return sqlite_work if engine.dialect.name == "sqlite" else nullcontext


_POOLED: weakref.WeakSet[IndexBase] = weakref.WeakSet()
"""Every open index of this process with pooled connections."""


def _after_fork_in_child() -> None:
    """A forked child never uses its parent's connections (SQLite forbids it; a PostgreSQL
    connection would interleave two processes' messages): it drops them unclosed, the
    parent's to keep, and its own pool opens new ones (SQLAlchemy's advice for fork)."""
    for index in list(_POOLED):
        index._engine.dispose(close=False)  # noqa: SLF001 - the class's own fork hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
