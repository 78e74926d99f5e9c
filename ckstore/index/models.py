"""The index schema at the head revision, as SQLAlchemy Core tables.

Core tables, not ORM classes: the index issues Core statements only, and leaving
``sqlalchemy.orm`` unimported keeps the command line quick. The migration scripts in
``migrations/versions`` create the same schema step by step and do not import this module, so
an old revision stays frozen when the tables move on; a test checks that both agree.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    false,
)

ID = String(128)
"""Column type of every object id (chunks, packs, manifests, snapshots, sessions)."""

NAME = String(128)
"""Column type of run, tag and snapshot names (see ``names.validate_name``)."""

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)
"""Every table of the index, with a naming convention so migrations can name constraints."""


def _required(name: str, type_: object, *args: object, **kw: object) -> Column[object]:
    return Column(name, type_, *args, nullable=False, **kw)  # type: ignore[arg-type]


meta = Table(
    "meta",
    metadata,
    Column("key", NAME, primary_key=True),
    _required("value", Text),
)
"""Store-wide key/value settings (format version, feature flags, store id)."""

packs = Table(
    "packs",
    metadata,
    Column("id", ID, primary_key=True),
    _required("size", BigInteger),
    _required("chunk_count", Integer),
    _required("created_at", Double),
    # set by GC when no chunk lives here any more; the object goes after the grace period
    Column("retired_at", Double, nullable=True),
    # written by a take with the fast codec; compaction rewrites its older chunks densely
    _required("loose", Boolean, server_default=false()),
    # revision 0006: a pack of this remote, not of the store (evicted chunks' rows point at it)
    Column("remote", NAME, nullable=True),
    # revision 0006: when a read last used this (local) pack; the least recently used go first
    Column("used_at", Double, nullable=True),
)
"""One pack object in the store, or (``remote`` set) in one of its remotes."""

chunks = Table(
    "chunks",
    metadata,
    Column("id", ID, primary_key=True),
    _required("pack_id", ID, ForeignKey("packs.id"), index=True),
    _required("offset", BigInteger),
    _required("length", BigInteger),
    _required("raw_length", BigInteger),
    _required("codec", String(32)),
    _required("created_at", Double),
    # a delta: the chunk its bytes are XORed against (the database keeps it while it is needed)
    Column("base_id", ID, ForeignKey("chunks.id"), nullable=True, index=True),
    _required("depth", Integer, server_default="0"),  # links down to the root's full chunk
    # XXH3-128 of the stored payload, from its writer (NULL for rows rebuilt from packs)
    Column("payload_digest", String(32), nullable=True),
)
"""Where a chunk lives: pack, byte range, codec, for a delta its base, and its payload's digest."""

manifests = Table(
    "manifests",
    metadata,
    Column("id", ID, primary_key=True),
    _required("size", BigInteger),
    _required("created_at", Double),
)
"""A manifest object (the analogue of a git tree)."""

manifest_entries = Table(
    "manifest_entries",
    metadata,
    Column("manifest_id", ID, ForeignKey("manifests.id"), primary_key=True),
    Column("key", Text, primary_key=True),
    _required("position", Integer),
    _required("kind", String(32)),
    Column("dtype", String(32), nullable=True),
    Column("shape", Text, nullable=True),
    _required("nbytes", BigInteger),
    _required("digest", String(128)),
)
"""One key of a manifest; ``position`` keeps the caller's order."""

runs = Table(
    "runs",
    metadata,
    Column("name", NAME, primary_key=True),
    _required("created_at", Double),
)
"""A run: a sequence of snapshots (the analogue of a branch)."""

snapshots = Table(
    "snapshots",
    metadata,
    Column("id", ID, primary_key=True),
    _required("run", NAME, ForeignKey("runs.name")),
    _required("seq", BigInteger),
    Column("step", BigInteger, nullable=True),
    Column("parent_id", ID, nullable=True),
    _required("manifest_id", ID, ForeignKey("manifests.id")),
    _required("created_at", Double),
    _required("metadata", Text),
    _required("logical_bytes", BigInteger),
    _required("new_bytes", BigInteger),
    _required("new_chunks", BigInteger),
    _required("reused_chunks", BigInteger),
    Column("name", NAME, nullable=True, unique=True),
    _required("world_size", Integer),
    # what the take found (revision 0005); NULL: not recorded (older snapshots: unknown)
    Column("nonfinite", BigInteger, nullable=True),  # NaN + Inf elements; 0 = healthy
    Column("stale", Integer, nullable=True),  # tensors that should have changed and did not
    Column("diverged", Integer, nullable=True),  # replicated tensors the ranks held apart (0008)
    Index("ix_snapshots_run_seq", "run", "seq", unique=True),
    Index("ix_snapshots_run_step", "run", "step"),
    Index("ix_snapshots_created_at", "created_at"),
    Index("ix_snapshots_manifest_id", "manifest_id"),
    Index("ix_snapshots_parent_id", "parent_id"),
)
"""A committed snapshot. ``seq`` is its commit order within the run (1, 2, ...); ``nonfinite``,
``stale`` and ``diverged`` summarise the health its take recorded in the manifest header."""

snapshot_chunks = Table(
    "snapshot_chunks",
    metadata,
    Column("snapshot_id", ID, ForeignKey("snapshots.id"), primary_key=True),
    Column("chunk_id", ID, ForeignKey("chunks.id"), primary_key=True, index=True),
)
"""A chunk referenced by a snapshot (what GC keeps alive)."""

tags = Table(
    "tags",
    metadata,
    Column("name", NAME, primary_key=True),
    _required("snapshot_id", ID, ForeignKey("snapshots.id"), index=True),
    _required("version", Integer),
    _required("updated_at", Double),
)
"""A named pointer to a snapshot; ``version`` is bumped on each move (compare-and-swap)."""

sessions = Table(
    "sessions",
    metadata,
    Column("id", ID, primary_key=True),
    _required("owner", String(255)),
    _required("started_at", Double),
    _required("heartbeat_at", Double),
    _required("expires_at", Double),
    _required("state", String(16)),
    Index("ix_sessions_state_expires_at", "state", "expires_at"),
)
"""A write lease held by a take in progress."""

pins = Table(
    "pins",
    metadata,
    Column("session_id", ID, ForeignKey("sessions.id"), primary_key=True),
    Column("chunk_id", ID, ForeignKey("chunks.id"), primary_key=True, index=True),
)
"""A chunk a write session relies on without having referenced it yet."""

remotes = Table(
    "remotes",
    metadata,
    Column("name", NAME, primary_key=True),
    _required("url", Text),
    Column("index_url", Text, nullable=True),
    _required("options", Text),  # storage options, JSON
    _required("tier", Boolean, server_default=false()),
    _required("created_at", Double),
    Column("store_id", Text, nullable=True),
)
"""A remote (revision 0006): another store this one pushes to and pulls from; ``tier``: this
store's persistent tier, which retention waits for; ``store_id`` (revision 0007): the id of the
store found there (its ``ckstore.json``) when it was added or first opened, checked on every
open (NULL until a store is found there)."""

remote_snapshots = Table(
    "remote_snapshots",
    metadata,
    Column("remote", NAME, ForeignKey("remotes.name"), primary_key=True),
    Column("snapshot_id", ID, primary_key=True, index=True),
    _required("pushed_at", Double),
)
"""A snapshot of this store that a remote is known to hold (revision 0006)."""
