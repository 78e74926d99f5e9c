"""Payload digests: the index records a digest of each chunk's stored payload.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Adds ``chunks.payload_digest`` (XXH3-128 of the stored payload in 32 hex digits, written by the
chunk's writer; NULL when unknown). An atomic restore checks stored payloads against it before
touching the destination, instead of decoding every chunk twice (docs/RELIABILITY.md, I3).
Existing rows keep NULL: readers verify those chunks the way they did before.

Frozen: spells out the column instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the nullable column, in place on both databases (no copy of ``chunks``)."""
    op.add_column("chunks", sa.Column("payload_digest", sa.String(32), nullable=True))


def downgrade() -> None:
    """Drops it again, in place (SQLite 3.35 and later drop a plain column without a copy)."""
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE chunks DROP COLUMN payload_digest")
    else:
        op.drop_column("chunks", "payload_digest")
