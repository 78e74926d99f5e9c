"""Engines for the index databases (SQLite and PostgreSQL), configured for safe concurrency.

SQLite: pysqlite's own transaction handling starts transactions lazily and loses updates under
concurrent writers, and a deferred ``BEGIN`` that later writes fails with "database is locked"
(``busy_timeout`` does not help a read-to-write upgrade). So the DBAPI connection runs with
``isolation_level=None`` and every SQLAlchemy transaction starts with ``BEGIN IMMEDIATE``: writers
queue on the write lock (waiting up to ``busy_timeout``) instead of failing or overwriting each
other. Transactions opened with the execution option ``ckstore_readonly=True`` use a deferred
``BEGIN`` so readers do not queue behind writers (WAL lets them read a stable snapshot).

PostgreSQL: the default READ COMMITTED level; the index code uses ``SELECT ... FOR UPDATE``,
atomic upserts or compare-and-swap updates wherever it reads and then writes.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from ckstore.errors import InvalidInputError
from ckstore.index.forks import sqlite_work
from ckstore.index.lite import DEFAULT_BUSY_TIMEOUT_S as DEFAULT_BUSY_TIMEOUT_S
from ckstore.index.sqlite_paths import sqlite_url

READONLY = "ckstore_readonly"
"""Execution option marking a read-only transaction (SQLite: deferred ``BEGIN``)."""


def parse_url(url: str | URL) -> URL:
    """Parses an index URL, mapping plain ``postgresql://`` to the psycopg 3 driver.

    Raises:
        InvalidInputError: If the URL cannot be parsed or names an unsupported database.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InvalidInputError(f"not a database URL: {url!r} ({exc})") from exc
    backend = parsed.get_backend_name()
    if backend == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if backend not in ("sqlite", "postgresql"):
        raise InvalidInputError(
            f"unsupported index database {parsed.drivername!r}: use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        )
    return parsed


def make_engine(
    url: str | URL,
    *,
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    read_only: bool = False,
    immutable: bool = False,
) -> Engine:
    """Creates an Engine for an index database.

    Args:
        url: SQLAlchemy URL (``sqlite:///path``, ``sqlite:///:memory:``,
            ``postgresql+psycopg://user@host:port/db``).
        busy_timeout_s: SQLite only: how long a writer waits for the write lock.
        read_only: open without writing anything: a SQLite file through a ``mode=ro`` URI
            (no WAL switch either), PostgreSQL with read-only transactions.
        immutable: SQLite only, with ``read_only``: open with ``immutable=1`` instead (no
            locks, no ``-shm`` file), which a WAL database on read-only media needs; only
            safe while nothing writes the file.

    Returns:
        A configured Engine (see the module docstring for the transaction rules).

    Raises:
        InvalidInputError: If the URL is malformed or the database kind is unsupported.
    """
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        read_only = read_only or is_read_only_url(parsed)
        immutable = immutable or str(parsed.query.get("immutable", "")) == "1"
        if read_only and not is_memory_sqlite(parsed):
            parsed = sqlite_read_only_url(parsed, immutable)
        return _sqlite_engine(parsed, busy_timeout_s, read_only)
    if read_only:
        return create_engine(
            parsed, pool_pre_ping=True,
            connect_args={"options": "-c default_transaction_read_only=on"},
        )  # fmt: skip
    return create_engine(parsed, pool_pre_ping=True)


def is_read_only_url(url: str | URL) -> bool:
    """True for a SQLite URL that opens read-only (``mode=ro`` or ``immutable=1``)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    query = parsed.query
    return str(query.get("mode", "")) == "ro" or str(query.get("immutable", "")) == "1"


def sqlite_read_only_url(url: URL, immutable: bool = False) -> URL:
    """The ``file:`` URI form of a SQLite URL that opens it read-only (or immutable)."""
    database = url.database or ""
    query = {k: v for k, v in url.query.items() if k not in ("mode", "immutable", "uri")}
    if not (database.startswith("file:") and str(url.query.get("uri", "")) == "true"):
        database = "file:" + quote(database, safe="/")
    query.update({"uri": "true", **({"immutable": "1"} if immutable else {"mode": "ro"})})
    return url.set(database=database, query=query)


def display_url(url: URL) -> str:
    """Renders a URL for messages and commands: password hidden, SQLite paths readable."""
    if url.get_backend_name() == "sqlite":
        database = url.database or ":memory:"
        if database.startswith("file:") and str(url.query.get("uri", "")) == "true":
            database = unquote(database[len("file:") :])
            return sqlite_url(database)  # a path that needs escaping keeps it: reusable
        return f"sqlite:///{database}"
    return url.render_as_string(hide_password=True)


def is_memory_sqlite(url: URL) -> bool:
    """Tells whether a SQLite URL names an in-memory database."""
    database = url.database or ""
    return database in ("", ":memory:") or "mode=memory" in str(url.query.get("mode", ""))


def sqlite_file(url: str | URL) -> str | None:
    """The database file a SQLite URL names (``file:`` URIs decoded), or None (in memory, or
    not SQLite)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite" or is_memory_sqlite(parsed):
        return None
    database = parsed.database or ""
    if database.startswith("file:") and str(parsed.query.get("uri", "")) == "true":
        database = unquote(database[len("file:") :].split("?", 1)[0])
    return database


def wal_files(path: str) -> list[str]:
    """The ``-wal`` and ``-shm`` files of the SQLite database ``path`` that exist now."""
    return [f"{path}{end}" for end in ("-wal", "-shm") if os.path.lexists(f"{path}{end}")]


def release_wal_files(path: str) -> None:
    """Have SQLite remove the ``-wal`` / ``-shm`` files a read-only connection made.

    A ``mode=ro`` connection to a WAL database makes them where the folder is writable and
    cannot remove them (removing is a write). SQLite removes them when its last connection
    closes: one read-write connection (never creating the database) reads and closes. If
    another connection still uses them (a writer that came meanwhile) they are its own and
    stay; the WAL holds no frame of ours, so nothing of the database changes. Errors are
    ignored: what stays is harmless, and the next writer uses it.
    """
    if not wal_files(path):
        return
    try:
        with sqlite_work():
            con = sqlite3.connect(f"file:{quote(path, safe='/')}?mode=rw", uri=True, timeout=1.0)
            try:
                con.execute("PRAGMA schema_version").fetchall()
            finally:
                con.close()
    except sqlite3.Error:
        pass


def _set_wal(cursor: Any, timeout_s: float) -> None:
    """Switch to WAL, retrying: the switch can answer "database is locked" at once, without
    waiting on the busy handler, while another process creates the same fresh database."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _sqlite_engine(url: URL, busy_timeout_s: float, read_only: bool = False) -> Engine:
    memory = is_memory_sqlite(url)
    kwargs: dict[str, Any] = {
        "connect_args": {"check_same_thread": False, "timeout": busy_timeout_s},
    }
    if memory:
        kwargs["poolclass"] = StaticPool
    engine = create_engine(url, **kwargs)
    busy_ms = int(busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        # synchronous stays at its default (FULL): a committed snapshot must survive power loss.
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if not memory and not read_only:  # switching to WAL writes the file
                _set_wal(cursor, busy_timeout_s)
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        readonly = read_only or connection.get_execution_options().get(READONLY, False)
        connection.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return engine
