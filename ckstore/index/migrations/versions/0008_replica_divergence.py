"""Replica divergence: how many replicated tensors a distributed take found different between ranks.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28

Adds ``snapshots.diverged``: the number of tensors whose replicas (a DDP module's, or keys a
``replicated=`` glob names) held other bytes on some ranks than on the others when the take
compared them (docs/FORMAT.md, section 7.6), NULL when it compared none (a single-process take,
and every snapshot taken before this revision: unknown). ``run@healthy`` and ``log --healthy``
skip a snapshot whose replicas diverged, as they skip one holding NaN or Inf or a stale one.

Frozen: spells out the column instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the nullable column, in place on both databases (no copy of ``snapshots``)."""
    op.add_column("snapshots", sa.Column("diverged", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drops it again, in place (SQLite 3.35 and later drop a plain column without a copy)."""
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE snapshots DROP COLUMN diverged")
    else:
        op.drop_column("snapshots", "diverged")
