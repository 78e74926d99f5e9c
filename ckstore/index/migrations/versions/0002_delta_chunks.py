"""Delta chunks: a chunk may be stored against a base chunk.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Adds ``chunks.base_id`` (the chunk a delta is XORed against; NULL for a full chunk; a foreign
key, so the database refuses to drop a base some delta needs) and ``chunks.depth`` (links to
the full chunk at the root of the chain: 0 for a full chunk). Existing rows are full chunks.

Frozen: spells out the columns instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Adds the base and depth columns to ``chunks``.

    In place on both databases: SQLite adds a column with an inline foreign key (a copy of the
    table, alembic's batch mode, would have to drop ``chunks``, which other tables reference).
    """
    if op.get_bind().dialect.name == "sqlite":
        op.execute(
            "ALTER TABLE chunks ADD COLUMN base_id VARCHAR(128) "
            "CONSTRAINT fk_chunks_base_id_chunks REFERENCES chunks (id)"
        )
    else:
        op.add_column("chunks", sa.Column("base_id", sa.String(128), nullable=True))
        op.create_foreign_key("fk_chunks_base_id_chunks", "chunks", "chunks", ["base_id"], ["id"])
    op.add_column("chunks", sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_chunks_base_id", "chunks", ["base_id"])


def downgrade() -> None:
    """Drops them again; refused while a delta is stored (its base would be forgotten and its
    bytes read as a full chunk's: PostgreSQL drops the columns in place, without a word)."""
    deltas = op.get_bind().scalar(sa.text("SELECT COUNT(*) FROM chunks WHERE base_id IS NOT NULL"))
    if deltas:
        raise RuntimeError(
            f"cannot downgrade the index below revision 0002: {deltas} chunk(s) are stored as "
            "deltas, which revision 0001 cannot describe; keep revision 0002 or later"
        )
    with op.batch_alter_table("chunks") as batch:
        batch.drop_index("ix_chunks_base_id")
        batch.drop_constraint("fk_chunks_base_id_chunks", type_="foreignkey")
        batch.drop_column("depth")
        batch.drop_column("base_id")
