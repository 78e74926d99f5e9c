"""Initial index schema.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Frozen: this script spells out the tables instead of importing the models, so it keeps creating
exactly the revision-0001 schema when the models change.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(128)
NAME = sa.String(128)


def _ts(name: str) -> sa.Column:
    return sa.Column(name, sa.Double(), nullable=False)


def upgrade() -> None:
    """Creates every table of revision 0001."""
    op.create_table(
        "meta",
        sa.Column("key", NAME, nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_meta"),
    )
    op.create_table(
        "packs",
        sa.Column("id", ID, nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("chunk_count", sa.Integer(), nullable=False),
        _ts("created_at"),
        sa.Column("retired_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_packs"),
    )
    op.create_table(
        "chunks",
        sa.Column("id", ID, nullable=False),
        sa.Column("pack_id", ID, nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.Column("raw_length", sa.BigInteger(), nullable=False),
        sa.Column("codec", sa.String(32), nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(["pack_id"], ["packs.id"], name="fk_chunks_pack_id_packs"),
        sa.PrimaryKeyConstraint("id", name="pk_chunks"),
    )
    op.create_index("ix_chunks_pack_id", "chunks", ["pack_id"])
    op.create_table(
        "manifests",
        sa.Column("id", ID, nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_manifests"),
    )
    op.create_table(
        "manifest_entries",
        sa.Column("manifest_id", ID, nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=True),
        sa.Column("shape", sa.Text(), nullable=True),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.ForeignKeyConstraint(
            ["manifest_id"], ["manifests.id"], name="fk_manifest_entries_manifest_id_manifests"
        ),
        sa.PrimaryKeyConstraint("manifest_id", "key", name="pk_manifest_entries"),
    )
    op.create_table(
        "runs",
        sa.Column("name", NAME, nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("name", name="pk_runs"),
    )
    _create_snapshots()
    op.create_table(
        "snapshot_chunks",
        sa.Column("snapshot_id", ID, nullable=False),
        sa.Column("chunk_id", ID, nullable=False),
        sa.ForeignKeyConstraint(
            ["snapshot_id"], ["snapshots.id"], name="fk_snapshot_chunks_snapshot_id_snapshots"
        ),
        sa.ForeignKeyConstraint(
            ["chunk_id"], ["chunks.id"], name="fk_snapshot_chunks_chunk_id_chunks"
        ),
        sa.PrimaryKeyConstraint("snapshot_id", "chunk_id", name="pk_snapshot_chunks"),
    )
    op.create_index("ix_snapshot_chunks_chunk_id", "snapshot_chunks", ["chunk_id"])
    op.create_table(
        "tags",
        sa.Column("name", NAME, nullable=False),
        sa.Column("snapshot_id", ID, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(
            ["snapshot_id"], ["snapshots.id"], name="fk_tags_snapshot_id_snapshots"
        ),
        sa.PrimaryKeyConstraint("name", name="pk_tags"),
    )
    op.create_index("ix_tags_snapshot_id", "tags", ["snapshot_id"])
    _create_sessions_and_pins()


def _create_snapshots() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", ID, nullable=False),
        sa.Column("run", NAME, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("parent_id", ID, nullable=True),
        sa.Column("manifest_id", ID, nullable=False),
        _ts("created_at"),
        sa.Column("metadata", sa.Text(), nullable=False),
        sa.Column("logical_bytes", sa.BigInteger(), nullable=False),
        sa.Column("new_bytes", sa.BigInteger(), nullable=False),
        sa.Column("new_chunks", sa.BigInteger(), nullable=False),
        sa.Column("reused_chunks", sa.BigInteger(), nullable=False),
        sa.Column("name", NAME, nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name="fk_snapshots_run_runs"),
        sa.ForeignKeyConstraint(
            ["manifest_id"], ["manifests.id"], name="fk_snapshots_manifest_id_manifests"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_snapshots"),
        sa.UniqueConstraint("name", name="uq_snapshots_name"),
    )
    op.create_index("ix_snapshots_run_seq", "snapshots", ["run", "seq"], unique=True)
    op.create_index("ix_snapshots_run_step", "snapshots", ["run", "step"])
    op.create_index("ix_snapshots_created_at", "snapshots", ["created_at"])
    op.create_index("ix_snapshots_manifest_id", "snapshots", ["manifest_id"])
    op.create_index("ix_snapshots_parent_id", "snapshots", ["parent_id"])


def _create_sessions_and_pins() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", ID, nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        _ts("started_at"),
        _ts("heartbeat_at"),
        _ts("expires_at"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_state_expires_at", "sessions", ["state", "expires_at"])
    op.create_table(
        "pins",
        sa.Column("session_id", ID, nullable=False),
        sa.Column("chunk_id", ID, nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_pins_session_id_sessions"
        ),
        sa.ForeignKeyConstraint(["chunk_id"], ["chunks.id"], name="fk_pins_chunk_id_chunks"),
        sa.PrimaryKeyConstraint("session_id", "chunk_id", name="pk_pins"),
    )
    op.create_index("ix_pins_chunk_id", "pins", ["chunk_id"])


def downgrade() -> None:
    """Drops every table of revision 0001."""
    for table in (
        "pins",
        "sessions",
        "tags",
        "snapshot_chunks",
        "snapshots",
        "runs",
        "manifest_entries",
        "manifests",
        "chunks",
        "packs",
        "meta",
    ):
        op.drop_table(table)
