"""SQLAlchemy declarative models of the index schema.

These classes describe the schema at the head revision. The migration scripts in
``migrations/versions`` create the same schema step by step and do not import this module, so
an old revision stays frozen when the models move on; a test checks that both agree.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

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


class Base(DeclarativeBase):
    """Declarative base with a naming convention, so migrations can name constraints."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Meta(Base):
    """Store-wide key/value settings (format version, feature flags, store id)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(NAME, primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Pack(Base):
    """One pack object in the store."""

    __tablename__ = "packs"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    chunk_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Double)
    retired_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    """Set by GC when no chunk lives here any more; the object goes after the grace period."""


class Chunk(Base):
    """Where a chunk lives: pack, byte range, codec."""

    __tablename__ = "chunks"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    pack_id: Mapped[str] = mapped_column(ForeignKey("packs.id"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    raw_length: Mapped[int] = mapped_column(BigInteger)
    codec: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Double)


class Manifest(Base):
    """A manifest object (the analogue of a git tree)."""

    __tablename__ = "manifests"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Double)


class ManifestEntry(Base):
    """One key of a manifest; ``position`` keeps the caller's order."""

    __tablename__ = "manifest_entries"
    manifest_id: Mapped[str] = mapped_column(ForeignKey("manifests.id"), primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    dtype: Mapped[str | None] = mapped_column(String(32))
    shape: Mapped[str | None] = mapped_column(Text)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str] = mapped_column(String(128))


class Run(Base):
    """A run: a sequence of snapshots (the analogue of a branch)."""

    __tablename__ = "runs"
    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    created_at: Mapped[float] = mapped_column(Double)


class Snapshot(Base):
    """A committed snapshot. ``seq`` is its commit order within the run (1, 2, ...)."""

    __tablename__ = "snapshots"
    __table_args__ = (
        Index("ix_snapshots_run_seq", "run", "seq", unique=True),
        Index("ix_snapshots_run_step", "run", "step"),
        Index("ix_snapshots_created_at", "created_at"),
        Index("ix_snapshots_manifest_id", "manifest_id"),
        Index("ix_snapshots_parent_id", "parent_id"),
    )
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run: Mapped[str] = mapped_column(ForeignKey("runs.name"))
    seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int | None] = mapped_column(BigInteger)
    parent_id: Mapped[str | None] = mapped_column(ID)
    manifest_id: Mapped[str] = mapped_column(ForeignKey("manifests.id"))
    created_at: Mapped[float] = mapped_column(Double)
    metadata_json: Mapped[str] = mapped_column("metadata", Text)
    logical_bytes: Mapped[int] = mapped_column(BigInteger)
    new_bytes: Mapped[int] = mapped_column(BigInteger)
    new_chunks: Mapped[int] = mapped_column(BigInteger)
    reused_chunks: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str | None] = mapped_column(NAME, unique=True)
    world_size: Mapped[int] = mapped_column(Integer)


class SnapshotChunk(Base):
    """A chunk referenced by a snapshot (what GC keeps alive)."""

    __tablename__ = "snapshot_chunks"
    snapshot_id: Mapped[str] = mapped_column(ForeignKey("snapshots.id"), primary_key=True)
    chunk_id: Mapped[str] = mapped_column(ForeignKey("chunks.id"), primary_key=True, index=True)


class Tag(Base):
    """A named pointer to a snapshot; ``version`` is bumped on each move (compare-and-swap)."""

    __tablename__ = "tags"
    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    snapshot_id: Mapped[str] = mapped_column(ForeignKey("snapshots.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[float] = mapped_column(Double)


class WriteSession(Base):
    """A write lease held by a take in progress."""

    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_state_expires_at", "state", "expires_at"),)
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    owner: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[float] = mapped_column(Double)
    heartbeat_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double)
    state: Mapped[str] = mapped_column(String(16))


class Pin(Base):
    """A chunk a write session relies on without having referenced it yet."""

    __tablename__ = "pins"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), primary_key=True)
    chunk_id: Mapped[str] = mapped_column(ForeignKey("chunks.id"), primary_key=True, index=True)
