"""Snapshot health: each snapshot's summary of what its take found, for filters and rollback.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

Adds ``snapshots.nonfinite`` (NaN and Inf elements the take counted in its tensors; 0 is a
healthy snapshot) and ``snapshots.stale`` (tensors that should have changed since the run's
previous snapshot and did not), both NULL when not recorded. ``ckstore log --healthy`` and the
ref ``run@healthy`` filter on ``nonfinite = 0`` without reading manifests. Snapshots taken
before this revision keep NULL: unknown, never taken for unhealthy.

Frozen: spells out the columns instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the two nullable columns, in place on both databases (no copy of ``snapshots``)."""
    op.add_column("snapshots", sa.Column("nonfinite", sa.BigInteger(), nullable=True))
    op.add_column("snapshots", sa.Column("stale", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drops them again, in place (SQLite 3.35 and later drop a plain column without a copy);
    refused while a snapshot records NaN/Inf or stale tensors: without the columns no snapshot
    is known healthy, so retention's newest healthy (the one ``run@healthy`` rolls back to)
    would no longer be kept beside a newer unhealthy one."""
    bind = op.get_bind()
    unhealthy = bind.scalar(
        sa.text("SELECT COUNT(*) FROM snapshots WHERE nonfinite > 0 OR stale > 0")
    )
    if unhealthy:
        raise RuntimeError(
            f"cannot downgrade the index below revision 0005: {unhealthy} snapshot(s) record "
            "NaN/Inf or stale tensors, which revision 0004 cannot describe (retention would "
            "stop keeping the newest healthy snapshot beside them); delete them first "
            "(`ckstore rm`) or keep revision 0005 or later"
        )
    if bind.dialect.name == "sqlite":
        op.execute("ALTER TABLE snapshots DROP COLUMN stale")
        op.execute("ALTER TABLE snapshots DROP COLUMN nonfinite")
    else:
        op.drop_column("snapshots", "stale")
        op.drop_column("snapshots", "nonfinite")
