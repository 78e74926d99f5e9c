"""Remote store ids: which store a remote is, so a missing or replaced one is never taken for it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27

Adds ``remotes.store_id``: the id in the ``ckstore.json`` of the store found at the remote's URL
when it was added, or when it was first opened (a first push creates it). Every open of the
remote compares it: another id there is another store (a share mounted elsewhere, a copy, a
bucket reused), refused; no store there is a missing remote, never created anew once the remote
was used (docs/RELIABILITY.md, I7). Remotes added before this revision keep NULL, and record
the id of the store their next open finds, when nothing says they were used before.

Frozen: spells out the column instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the nullable column, in place on both databases (no copy of ``remotes``)."""
    op.add_column("remotes", sa.Column("store_id", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drops it again, in place (SQLite 3.35 and later drop a plain column without a copy)."""
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE remotes DROP COLUMN store_id")
    else:
        op.drop_column("remotes", "store_id")
