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
    """Drops it again, in place (SQLite 3.35 and later drop a plain column without a copy);
    refused while a snapshot records replicas that diverged: without the column it would pass
    for healthy (``run@healthy``, ``log --healthy``, and retention's newest healthy, which
    then keeps it and may delete the one a rollback needs)."""
    bind = op.get_bind()
    diverged = bind.scalar(sa.text("SELECT COUNT(*) FROM snapshots WHERE diverged > 0"))
    if diverged:
        raise RuntimeError(
            f"cannot downgrade the index below revision 0008: {diverged} snapshot(s) record "
            "replicas that diverged, which revision 0007 cannot describe (they would pass for "
            "healthy); delete them first (`ckstore rm`) or keep revision 0008 or later"
        )
    if bind.dialect.name == "sqlite":
        op.execute("ALTER TABLE snapshots DROP COLUMN diverged")
    else:
        op.drop_column("snapshots", "diverged")
