"""Schema versioning: creation, frozen old databases, older and newer revisions."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from ckstore.errors import SchemaError
from ckstore.index import (
    ChunkRecord,
    Index,
    PackRecord,
    current_revision,
    ensure_schema,
    head_revision,
    make_engine,
    upgrade,
)
from ckstore.index.models import metadata
from ckstore.index.schema import HEAD_REVISION, MIGRATIONS_DIR

from . import fixture_data as frozen
from .helpers import commit


def test_new_database_is_stamped_at_head(index_url: str) -> None:
    Index.open(index_url).close()
    engine = make_engine(index_url)
    try:
        assert current_revision(engine) == head_revision() == HEAD_REVISION
    finally:
        engine.dispose()


def test_head_revision_constant_names_the_newest_script() -> None:
    """Opening an index at the head compares against this constant, without alembic."""
    assert HEAD_REVISION == head_revision()


def test_opening_an_index_at_head_imports_no_alembic(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'i.sqlite'}"
    Index.open(url).close()
    code = (
        "import sys; from ckstore.index import Index; Index.open(sys.argv[1]).close(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, url], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_migrations_build_the_models_schema(index_url: str) -> None:
    """The migration scripts (what ``ckstore migrate`` runs) and the models must agree."""
    assert upgrade(index_url) == head_revision()
    engine = make_engine(index_url)
    try:
        with engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diffs == []
    finally:
        engine.dispose()
    with Index.open(index_url) as ix:  # and the result is a working index
        commit(ix, "r", 1)
        assert ix.resolve("r@1").step == 1


def test_unknown_revision_is_refused(index_url: str) -> None:
    Index.open(index_url).close()
    _set_revision(index_url, "9999_from_the_future")
    with pytest.raises(SchemaError, match="newer ckstore") as err:
        Index.open(index_url)
    assert "Upgrade ckstore" in str(err.value)
    with pytest.raises(SchemaError, match="newer ckstore"):
        upgrade(index_url)  # an old ckstore must not "upgrade" a newer database either


def test_foreign_database_is_refused(index_url: str) -> None:
    engine = make_engine(index_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE users (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(SchemaError, match="not a ckstore index"):
        Index.open(index_url)


def test_frozen_revision_0001_database_upgrades_and_keeps_its_data(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    shutil.copyfile(frozen.FILE, path)
    url = f"sqlite:///{path}"
    with pytest.raises(SchemaError, match=f"ckstore migrate --index {url}"):
        Index.open(url, create=False)  # never upgraded behind the user's back
    assert upgrade(url) == HEAD_REVISION
    with Index.open(url, create=False) as ix:
        # every chunk of revision 0001 is a full chunk, with no payload digest recorded
        assert {(c.base_id, c.depth, c.payload_digest) for c in ix.all_chunks()} == {
            (None, 0, None)
        }
        assert {k: ix.get_meta(k) for k in frozen.META} == frozen.META
        assert ix.list_runs() == sorted({s[1] for s in frozen.SNAPSHOTS})
        for snap_id, run, step, created, name, chunk_idx, tags in frozen.SNAPSHOTS:
            got = ix.get_snapshot(snap_id)
            assert (got.run, got.step, got.created_at, got.name) == (run, step, created, name)
            assert got.metadata == {"step": step}
            ids = {list(frozen.CHUNKS)[i] for i in chunk_idx}
            assert ix.snapshot_chunk_ids(snap_id) == ids
            assert ix.stored_bytes(snap_id) == sum(frozen.CHUNKS[c][2] for c in ids)
            assert [t.name for t in ix.list_tags(snap_id)] == list(tags)
            entry = ix.entries(got.manifest_id)[0]
            assert (entry.key, entry.shape, entry.digest) == (
                frozen.ENTRY[0],
                frozen.ENTRY[3],
                frozen.ENTRY[5],
            )
        assert ix.resolve("sft").id == frozen.SNAPSHOTS[1][0]
        assert ix.resolve("sft").parent_id == frozen.SNAPSHOTS[0][0]
        assert ix.resolve("best").id == ix.resolve("sft-final").id == frozen.SNAPSHOTS[1][0]
        commit(ix, "sft", 300)  # and it takes new writes
        assert ix.resolve("sft").step == 300


# Test-only revision NEXT (one past the shipped head). To exercise the "older revision" path against the shipped head we
# build a migration directory holding the shipped env.py and revisions plus this one, and run
# the same check/upgrade code against it. A database the shipped code created (at the shipped
# head) is then genuinely older than that directory's head.
NEXT = f"{int(HEAD_REVISION) + 1:04d}"
REVISION_TEST_ONLY = f'''"""Test-only revision.

Revision ID: {NEXT}
Revises: {HEAD_REVISION}
"""
import sqlalchemy as sa
from alembic import op

revision = "{NEXT}"
down_revision = "{HEAD_REVISION}"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("description", sa.Text(), nullable=True))


def downgrade():
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("description")
'''


@pytest.fixture
def scripts_with_test_only(tmp_path: Path) -> Path:
    location = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, location, ignore=shutil.ignore_patterns("__pycache__"))
    (location / "versions" / f"{NEXT}_test_only.py").write_text(REVISION_TEST_ONLY)
    return location


def test_older_revision_is_refused_with_migrate_command(
    index_url: str, scripts_with_test_only: Path
) -> None:
    with Index.open(index_url) as ix:  # the shipped code creates it at its head
        commit(ix, "r", 1)
    engine = make_engine(index_url)
    try:
        with pytest.raises(SchemaError) as err:
            ensure_schema(engine, script_location=scripts_with_test_only)
        message = str(err.value)
        assert HEAD_REVISION in message and NEXT in message
        assert f"ckstore migrate --index {index_url}" in message
        assert upgrade(index_url, script_location=scripts_with_test_only) == NEXT
        ensure_schema(engine, script_location=scripts_with_test_only)  # now current: opens
        assert current_revision(engine) == NEXT
    finally:
        engine.dispose()
    with pytest.raises(SchemaError, match="newer ckstore"):  # the shipped code: NEXT is new
        Index.open(index_url)


def test_payload_digests_migrate_down_and_up_in_place(index_url: str) -> None:
    """0003 adds ``chunks.payload_digest``; its downgrade drops it and keeps every row; the
    upgrade then leaves old rows without a digest (their readers decode them to verify)."""
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        session = ix.begin_session("test", 30)
        rec = ChunkRecord("ab" * 32, "p1", 0, 5, 64, "zstd", payload_digest="cd" * 16)
        ix.add_pack(session.id, PackRecord("p1", 10, 1), [rec])
        assert ix.chunk_locations([rec.chunk_id])[rec.chunk_id] == rec
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0002")
        with engine.connect() as conn:
            assert current_revision(engine) == "0002"
            row = conn.execute(text("SELECT * FROM chunks")).mappings().one()
            assert (
                "payload_digest" not in row and row["id"] == rec.chunk_id and row["codec"] == "zstd"
            )
    finally:
        engine.dispose()
    with pytest.raises(SchemaError, match=re.escape(f"ckstore migrate --index {index_url}")):
        Index.open(index_url, create=False)
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        got = ix.chunk_locations([rec.chunk_id])[rec.chunk_id]
        assert got == ChunkRecord(rec.chunk_id, "p1", 0, 5, 64, "zstd")  # the digest is unknown now


def test_loose_packs_migrate_down_and_up_in_place(index_url: str) -> None:
    """0004 adds ``packs.loose``; its downgrade drops it and keeps every pack and chunk; the
    upgrade then counts every existing pack as dense (they were written before fast takes)."""
    from alembic import command

    from ckstore.index.schema import alembic_config

    with Index.open(index_url) as ix:
        session = ix.begin_session("test", 30)
        rec = ChunkRecord("ab" * 32, "p1", 0, 5, 64, "exp-zstd")
        ix.add_pack(session.id, PackRecord("p1", 10, 1, loose=True), [rec])
        assert [c.chunk_id for c in ix.loose_chunks()] == [rec.chunk_id]
    engine = make_engine(index_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0003")
        with engine.connect() as conn:
            assert current_revision(engine) == "0003"
            row = conn.execute(text("SELECT * FROM packs")).mappings().one()
            assert "loose" not in row and row["id"] == "p1"
    finally:
        engine.dispose()
    assert upgrade(index_url) == HEAD_REVISION
    with Index.open(index_url, create=False) as ix:
        assert ix.chunk_locations([rec.chunk_id])[rec.chunk_id] == rec
        assert ix.loose_chunks() == []  # an existing pack counts as dense


def _set_revision(url: str, revision: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()
