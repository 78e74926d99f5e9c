"""Loose packs: the index records which packs a take wrote with its fast codec.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

Adds ``packs.loose`` (false by default): a take writes its new chunks *loose*, with the fast
codec and no deltas (``exp-zstd`` for floats, raw otherwise), and compaction later rewrites the
chunks of older snapshots into dense packs (byte-grouped zstd and XOR deltas), as ``git gc``
packs loose objects. Packs already in the store were written densely: they stay ``false``.

Frozen: spells out the column instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the column with its default, in place on both databases (no copy of ``packs``)."""
    op.add_column(
        "packs", sa.Column("loose", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    """Drops it again, in place (SQLite 3.35 and later drop a plain column without a copy)."""
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE packs DROP COLUMN loose")
    else:
        op.drop_column("packs", "loose")
