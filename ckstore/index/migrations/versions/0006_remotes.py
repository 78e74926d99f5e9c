"""Remotes: where a store pushes and pulls, what each holds of it, and chunks it evicted there.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25

Adds three things (docs/FORMAT.md, section 8):

- ``remotes``: the store's remotes, named as git names them (``name`` -> ``url``, the index URL
  and the storage options as JSON), and ``tier``: the remote is this store's persistent tier
  (``ckstore.open(..., push_to=NAME)``), so retention keeps what it does not hold yet.
- ``remote_snapshots``: which snapshots of this store a remote is known to hold (pushed there,
  pulled from there, or found there by a push), and since when.
- ``packs.remote`` and ``packs.used_at``: a pack row whose ``remote`` names a remote is a pack
  of that remote, not of this store: the rows of chunks evicted from the local tier point at
  it (``local_budget``), and a read goes there. ``used_at`` is when a read last used a local
  pack (least recently used packs are evicted first); NULL: never recorded.

Frozen: spells out the tables and columns instead of importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Creates the two tables; adds the two nullable columns in place (no copy of ``packs``)."""
    op.create_table(
        "remotes",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("index_url", sa.Text(), nullable=True),
        sa.Column("options", sa.Text(), nullable=False),
        sa.Column("tier", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_remotes"),
    )
    op.create_table(
        "remote_snapshots",
        sa.Column("remote", sa.String(128), nullable=False),
        sa.Column("snapshot_id", sa.String(128), nullable=False),
        sa.Column("pushed_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["remote"], ["remotes.name"], name="fk_remote_snapshots_remote_remotes"
        ),
        sa.PrimaryKeyConstraint("remote", "snapshot_id", name="pk_remote_snapshots"),
    )
    op.create_index("ix_remote_snapshots_snapshot_id", "remote_snapshots", ["snapshot_id"])
    op.add_column("packs", sa.Column("remote", sa.String(128), nullable=True))
    op.add_column("packs", sa.Column("used_at", sa.Double(), nullable=True))


def downgrade() -> None:
    """Drops them again (SQLite 3.35 and later drop a plain column without a copy); refused
    while a chunk is evicted to a remote (``packs.remote`` set): its row would then name a
    local pack the store lacks, and the only record of where its bytes are would be gone."""
    bind = op.get_bind()
    evicted = bind.scalar(
        sa.text(
            "SELECT COUNT(*) FROM chunks JOIN packs ON chunks.pack_id = packs.id"
            " WHERE packs.remote IS NOT NULL"
        )
    )
    if evicted:
        raise RuntimeError(
            f"cannot downgrade the index below revision 0006: {evicted} chunk(s) are evicted "
            "to a remote (the store's tier), which revision 0005 cannot describe; bring them "
            "back first (`Store.hydrate()`, with the store opened without `local_budget`) or "
            "keep revision 0006 or later"
        )
    if bind.dialect.name == "sqlite":
        op.execute("ALTER TABLE packs DROP COLUMN used_at")
        op.execute("ALTER TABLE packs DROP COLUMN remote")
    else:
        op.drop_column("packs", "used_at")
        op.drop_column("packs", "remote")
    op.drop_index("ix_remote_snapshots_snapshot_id", table_name="remote_snapshots")
    op.drop_table("remote_snapshots")
    op.drop_table("remotes")
