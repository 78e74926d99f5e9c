"""The index: the dedup oracle and the commit point of a ckstore store.

Contract:

* Every method runs in its own short transaction and is atomic: it either does all it says or
  raises and changes nothing.
* An :class:`Index` may be shared by threads; several processes may open the same database.
  On SQLite every write transaction starts with ``BEGIN IMMEDIATE`` (writers queue, no lost
  updates); on PostgreSQL read-then-write paths lock rows or compare-and-swap.
* Chunks a writer relies on are pinned to its write session (lease) from the moment the index
  reports them, until the session commits or ends; GC must leave pinned chunks alone while the
  lease is valid. A writer whose lease has expired cannot pin or commit (LeaseExpiredError).
* Errors are ckstore errors: LeaseExpiredError, ConflictError, NotFoundError (and
  SnapshotNotFoundError), InvalidInputError, SchemaError, and IndexError_ for database failures.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from ckstore.errors import (
    IndexError_,
    InvalidInputError,
    LeaseExpiredError,
    NotFoundError,
    ReadOnlyStoreError,
    SnapshotNotFoundError,
)
from ckstore.index import _commit, _convert, _refnames, _resolve, _sql
from ckstore.index._errors import translated
from ckstore.index._sql import batches, check_lease, insert, insert_ignore, unique
from ckstore.index.compaction import CompactionMixin
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
from ckstore.index.edits import EditsMixin
from ckstore.index.maintenance import MaintenanceMixin
from ckstore.index.records import (
    ChunkRecord,
    EntryRecord,
    PackRecord,
    SessionRecord,
    SnapshotRecord,
)
from ckstore.index.remote import RemotesMixin
from ckstore.index.schema import ensure_schema
from ckstore.index.sharing import SharingMixin

FINAL_STATES = ("committed", "aborted")
MAX_CHAIN_ROUNDS = 65
"""Lookups :meth:`Index.chunk_locations` makes to follow delta chains (one per link; chains
are far shorter, and readers refuse one over 64 links)."""


class Index(MaintenanceMixin, SharingMixin, CompactionMixin, EditsMixin, RemotesMixin):
    """SQL index of one store (SQLite or PostgreSQL). Create it with :meth:`Index.open`."""

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

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, url: str, *, create: bool = True, read_only: str | bool | None = None) -> Index:
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
        try:
            engine = cls._checked(engine, url, create, reason)
        except BaseException:
            engine.dispose()
            if tidy is not None:
                release_wal_files(tidy)
            raise
        return cls(engine, reason, tidy=tidy)

    @staticmethod
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

    @property
    def read_only(self) -> str | None:
        """Why this index refuses writes, or None when it is writable."""
        return self._read_only

    def close(self) -> None:
        """Closes every pooled connection. The Index must not be used afterwards."""
        self._engine.dispose()
        if self._tidy is not None:
            release_wal_files(self._tidy)

    def __enter__(self) -> Index:
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

    @contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        if self._read_only is not None:
            raise ReadOnlyStoreError(f"cannot {what}: {self._read_only}")
        with self._lock, translated(what, self._url), self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        with self._lock, translated(what, self._url), self._engine.connect() as conn:
            conn.execution_options(**{READONLY: True})
            with conn.begin():
                yield conn

    # ---------------------------------------------------------------------- meta
    def get_meta(self, key: str) -> str | None:
        """Returns a store-wide setting, or None if unset."""
        with self._read(f"read meta {key!r}") as conn:
            return conn.scalar(select(_sql.meta.c.value).where(_sql.meta.c.key == key))

    def set_meta(self, key: str, value: str, *, only_if_absent: bool = False) -> str:
        """Stores a setting and returns the value now stored.

        Args:
            key: Setting name.
            value: Setting value.
            only_if_absent: Keep an existing value (first writer wins); the return value then
                tells the caller which value is in force.
        """
        m = _sql.meta
        with self._write(f"write meta {key!r}") as conn:
            if only_if_absent:
                insert_ignore(conn, m, [{"key": key, "value": value}])
            else:
                stmt = insert(conn, m).values(key=key, value=value)
                conn.execute(
                    stmt.on_conflict_do_update(index_elements=[m.c.key], set_={"value": value})
                )
            return str(conn.scalar(select(m.c.value).where(m.c.key == key)))

    # ------------------------------------------------------------ write sessions
    def begin_session(self, owner: str, lease_seconds: float) -> SessionRecord:
        """Starts a write session holding a lease of ``lease_seconds``.

        Raises:
            InvalidInputError: If ``lease_seconds`` is not positive.
        """
        if not lease_seconds > 0:
            raise InvalidInputError(f"lease_seconds must be > 0, got {lease_seconds}")
        now = time.time()
        record = SessionRecord(
            id=uuid.uuid4().hex,
            owner=str(owner)[:255],
            started_at=now,
            heartbeat_at=now,
            expires_at=now + lease_seconds,
            state=_sql.ACTIVE,
        )
        with self._write("begin write session") as conn:
            conn.execute(insert(conn, _sql.sessions), dataclasses.asdict(record))
        return record

    def heartbeat(self, session_id: str, lease_seconds: float) -> None:
        """Extends an active, unexpired lease to ``lease_seconds`` from now.

        Raises:
            LeaseExpiredError: If the session is unknown, ended, or its lease already expired.
        """
        s = _sql.sessions
        with self._write(f"heartbeat session {session_id}") as conn:
            now = time.time()
            result = conn.execute(
                update(s)
                .where((s.c.id == session_id) & (s.c.state == _sql.ACTIVE))
                .where(s.c.expires_at >= now)
                .values(heartbeat_at=now, expires_at=now + lease_seconds)
            )
            if result.rowcount != 1:
                check_lease(conn, session_id)  # raises with the precise reason
                raise LeaseExpiredError(f"write session {session_id} could not be extended")

    def end_session(self, session_id: str, state: str) -> None:
        """Ends a session as ``"committed"`` or ``"aborted"`` and drops its pins.

        Raises:
            InvalidInputError: For any other state.
            NotFoundError: If the session does not exist.
        """
        if state not in FINAL_STATES:
            raise InvalidInputError(f"a session ends as one of {FINAL_STATES}, not {state!r}")
        with self._write(f"end session {session_id}") as conn:
            if _commit.finish_session(conn, session_id, state) != 1:
                raise NotFoundError(f"no write session {session_id}")

    # -------------------------------------------------------------- dedup oracle
    def lookup_chunks(self, session_id: str, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """Returns the chunks among ``chunk_ids`` the index has, pinning each to the session.

        The lease check, the lookup and the pins happen in one transaction, so a chunk
        reported here cannot be collected while the lease is valid.

        Raises:
            LeaseExpiredError: If the session's lease is no longer valid (nothing is pinned).
        """
        ids = unique(chunk_ids)
        c = _sql.chunks
        found: dict[str, ChunkRecord] = {}
        with self._write(f"look up chunks for session {session_id}") as conn:
            check_lease(conn, session_id)
            for batch in batches(ids):
                query = select(c).where(c.c.id.in_(batch))
                # PostgreSQL: FOR KEY SHARE keeps a concurrent GC from deleting these rows
                # before the pins below commit.
                rows = conn.execute(query.with_for_update(read=True, key_share=True)).all()
                insert_ignore(
                    conn, _sql.pins, [{"session_id": session_id, "chunk_id": r.id} for r in rows]
                )
                found.update((r.id, _convert.chunk(r)) for r in rows)
        return found

    def add_pack(self, session_id: str, pack: PackRecord, chunks: Sequence[ChunkRecord]) -> None:
        """Records a durable pack and its chunks, pinning every chunk to the session.

        Idempotent: a pack or chunk id already present is left as it is (the first location
        recorded for a chunk stays its location).

        Raises:
            LeaseExpiredError: If the session's lease is no longer valid.
            InvalidInputError: If a chunk claims to live in another pack.
        """
        _commit.check_pack(pack, chunks)
        with self._write(f"add pack {pack.pack_id}") as conn:
            now = check_lease(conn, session_id)
            _commit.add_pack(conn, pack, chunks, now, pin_for=session_id)

    def chunk_locations(self, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """Returns where each known chunk among ``chunk_ids`` lives (no pins; for reads).

        The result also holds the bases of every delta among them, down to the full chunk at
        the root of each chain (in one read transaction, so a chain is seen whole), which is
        everything a reader needs to decode them.
        """
        c = _sql.chunks
        found: dict[str, ChunkRecord] = {}
        with self._read("locate chunks") as conn:
            todo = unique(chunk_ids)
            for _ in range(MAX_CHAIN_ROUNDS):
                for batch in batches(todo):
                    found.update(
                        (r.id, _convert.chunk(r))
                        for r in conn.execute(select(c).where(c.c.id.in_(batch)))
                    )
                todo = unique(
                    r.base_id
                    for r in found.values()
                    if r.base_id is not None and r.base_id not in found
                )
                if not todo:
                    break
        return found

    # -------------------------------------------------------------------- commit
    def commit_snapshot(
        self,
        session_id: str,
        snapshot: SnapshotRecord,
        entries: Sequence[EntryRecord],
        chunk_ids: Iterable[str],
        manifest_size: int,
        tags: Sequence[str] = (),
        packs: Sequence[tuple[PackRecord, Sequence[ChunkRecord]]] = (),
    ) -> SnapshotRecord:
        """Commits a snapshot in one transaction; the snapshot exists iff this returns.

        In order: the session must be active and unexpired; ``packs`` (durable packs this take
        wrote and did not :meth:`add_pack`: one transaction for both, the last pack of a small
        take typically) are recorded with their chunks; every chunk id must be in the
        index; the names must keep their meaning (:meth:`check_take`); the run is created if
        missing; ``parent_id`` becomes the run's latest snapshot at commit time (the caller's
        value is ignored); the manifest and its entries are inserted unless the manifest id
        exists; the snapshot and its chunk references are inserted; each tag is created or
        moved to it; the session becomes committed and its pins are dropped.

        ``tags`` are specs (:func:`tag_specs`): ``"name"`` creates a tag and is refused if
        the tag exists at another snapshot; ``"+name"`` creates or moves it.

        Returns:
            The stored record, with ``parent_id`` filled in.

        Raises:
            LeaseExpiredError: If the lease is no longer valid.
            NotFoundError: If a chunk id is not in the index (the message names one).
            ConflictError: If the snapshot id or name is taken, a tag exists and may not move,
                a tag has the name of a run, or a new run the name of a tag.
            InvalidInputError: If the run, name or a tag name is invalid.
        """
        ids = unique(chunk_ids)
        for pack, chunks in packs:
            _commit.check_pack(pack, chunks)
        with self._write(f"commit snapshot {snapshot.id}") as conn:
            return _commit.commit(
                conn, session_id, snapshot, entries, ids, manifest_size, list(tags), packs
            )

    def check_take(self, run: str, tags: Sequence[str] = ()) -> None:
        """Refuses, before anything is written, a take the commit would refuse for its names:
        a tag (spec, see :meth:`commit_snapshot`) that exists and may not move, a tag named like
        a run with snapshots, a new run named like a tag. The commit checks again.

        Raises:
            ConflictError: Naming the clash and what to do instead.
        """
        with self._read(f"check names for a take into run {run!r}") as conn:
            _refnames.check_take(conn, run, tags)

    # --------------------------------------------------------------------- reads
    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """Returns the snapshot with this exact id.

        Raises:
            SnapshotNotFoundError: If there is none.
        """
        s = _sql.snapshots
        with self._read(f"read snapshot {snapshot_id}") as conn:
            row = conn.execute(select(s).where(s.c.id == snapshot_id)).first()
            if row is None:
                raise SnapshotNotFoundError(f"no snapshot with id {snapshot_id}")
            return _convert.snapshot(row)

    def resolve(self, ref: str) -> SnapshotRecord:
        """Finds the snapshot a ref names.

        Tried in order: ``run@step`` (the newest snapshot of that run at that step), a tag, a
        snapshot name, a run name (its latest snapshot), a snapshot id or a hex id prefix of at
        least 4 characters.

        Raises:
            SnapshotNotFoundError: If nothing matches (the message lists what was tried and a
                few known runs and tags).
            InvalidInputError: If an id prefix is ambiguous (the message lists candidates).
        """
        with self._read(f"resolve {ref!r}") as conn:
            return _convert.snapshot(_resolve.resolve(conn, ref))

    def list_snapshots(
        self, run: str | None = None, limit: int | None = None, *, healthy: bool = False
    ) -> list[SnapshotRecord]:
        """Lists snapshots newest first: by commit order within a run, else by created_at.

        ``healthy`` keeps only snapshots whose take recorded no NaN or Inf (``nonfinite = 0``;
        those without a record are unknown and left out), from the index alone.

        Raises:
            InvalidInputError: If ``limit`` is not None or an int from 0 to 2**63-1.
        """
        if limit is not None and (
            not isinstance(limit, int)
            or isinstance(limit, bool)
            or not 0 <= limit <= _resolve.MAX_STEP
        ):
            raise InvalidInputError(
                f"limit must be None or an int from 0 to 2**63-1, got {limit!r}"
            )
        s = _sql.snapshots
        query = select(s)
        if healthy:
            query = query.where(s.c.nonfinite == 0)
        if run is not None:
            query = query.where(s.c.run == run).order_by(s.c.seq.desc())
        else:
            query = query.order_by(s.c.created_at.desc(), s.c.seq.desc(), s.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        with self._read("list snapshots") as conn:
            return [_convert.snapshot(r) for r in conn.execute(query)]

    def list_runs(self) -> list[str]:
        """Lists the names of runs that have snapshots, in name order (a run whose snapshots
        were all deleted is not listed)."""
        s = _sql.snapshots
        with self._read("list runs") as conn:
            return list(conn.scalars(select(s.c.run).distinct().order_by(s.c.run)))

    def entries(self, manifest_id: str) -> list[EntryRecord]:
        """Returns a manifest's entries in the order they were committed (empty if unknown)."""
        e = _sql.manifest_entries
        query = select(e).where(e.c.manifest_id == manifest_id).order_by(e.c.position)
        with self._read(f"read manifest {manifest_id}") as conn:
            return [_convert.entry(r) for r in conn.execute(query)]

    def snapshot_chunk_ids(self, snapshot_id: str) -> set[str]:
        """Returns the ids of the chunks a snapshot references."""
        sc = _sql.snapshot_chunks
        with self._read(f"read chunks of {snapshot_id}") as conn:
            return set(conn.scalars(select(sc.c.chunk_id).where(sc.c.snapshot_id == snapshot_id)))

    def stored_bytes(self, snapshot_id: str) -> int:
        """Returns the stored (compressed) size of the chunks a snapshot references."""
        sc, c = _sql.snapshot_chunks, _sql.chunks
        query = (
            select(func.coalesce(func.sum(c.c.length), 0))
            .select_from(sc.join(c, c.c.id == sc.c.chunk_id))
            .where(sc.c.snapshot_id == snapshot_id)
        )
        with self._read(f"size snapshot {snapshot_id}") as conn:
            return int(conn.scalar(query) or 0)
