"""Schema versioning of the index: create, check and upgrade.

Rules (in the manner of optuna's RDB storage):

* A new, empty database gets every table from the models and is stamped at the head revision.
* A database at the head revision opens.
* A database at an older revision this code knows is refused with :class:`SchemaError` whose
  message holds the command that upgrades it: ``ckstore migrate --index <url>`` (which calls
  :func:`upgrade`). Upgrades are never run implicitly: other processes may still run the old code.
* A revision this code does not know was written by a newer ckstore: refused, upgrade ckstore.
* A database with tables but no ``alembic_version`` is not a ckstore index: refused.

Opening an index at :data:`HEAD_REVISION` reads the version table with plain SQL; alembic (slow
to import) is loaded only to create, check an unexpected revision, or upgrade.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

from ckstore.errors import NotFoundError, SchemaError
from ckstore.index.db import READONLY, display_url, make_engine
from ckstore.index.lite import HEAD_REVISION as HEAD_REVISION
from ckstore.index.models import metadata

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version"
_PG_LOCK_KEY = 0x636B73746F7265  # "ckstore": serializes schema creation on PostgreSQL


def alembic_config(
    *,
    connection: Connection | None = None,
    url: str | None = None,
    script_location: Path | None = None,
) -> Config:
    """Builds the alembic configuration in code (no alembic.ini is shipped).

    Args:
        connection: An open connection for the migration to use.
        url: Database URL, used when no connection is given.
        script_location: Migration scripts directory (tests only; default: the shipped ones).
    """
    from alembic.config import Config

    config = Config()
    location = str(script_location or MIGRATIONS_DIR)
    config.set_main_option("script_location", location.replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    config.attributes["connection"] = connection
    config.attributes["url"] = url
    return config


def script_directory(script_location: Path | None = None) -> ScriptDirectory:
    """Returns the migration scripts directory."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(script_location=script_location))


def head_revision(script_location: Path | None = None) -> str:
    """Returns the newest schema revision this code knows."""
    head = script_directory(script_location).get_current_head()
    assert head is not None, "migration scripts define no revision"
    return head


def migrate_command(url: str) -> str:
    """Returns the shell command that upgrades the index at ``url`` to this code's schema."""
    return f"ckstore migrate --index {url}"


def ensure_schema(
    engine: Engine, *, create: bool = True, script_location: Path | None = None
) -> None:
    """Checks the schema of an index database, creating it when the database is empty.

    Args:
        engine: Engine from :func:`ckstore.index.db.make_engine`.
        create: Whether an empty database gets the schema (else NotFoundError).
        script_location: Migration scripts directory (tests only).

    Raises:
        SchemaError: If the database is older or newer than this code, or not a ckstore index.
        NotFoundError: If the database is empty and ``create`` is False.
    """
    url = _display_url(engine)
    with engine.connect() as conn:
        conn.execution_options(**{READONLY: True})
        with conn.begin():
            revision = _stored_revision(conn, url)
    if revision == HEAD_REVISION and script_location is None:
        return  # the common case, without importing alembic
    from alembic.runtime.migration import MigrationContext

    script = script_directory(script_location)
    if revision is not None:
        _check_revision(revision, script, url)
        return
    with _schema_lock(engine) as conn:
        revision = _stored_revision(conn, url)
        if revision is not None:  # another process created it meanwhile
            _check_revision(revision, script, url)
            return
        if not create:
            raise NotFoundError(f"no ckstore index at {url} (open it with create=True)")
        metadata.create_all(conn)
        MigrationContext.configure(conn).stamp(script, "head")


def upgrade(url: str, *, script_location: Path | None = None) -> str:
    """Upgrades the index at ``url`` to the newest schema revision (``ckstore migrate``).

    An empty database gets the whole schema through the migration scripts.

    Returns:
        The revision the database is at afterwards.

    Raises:
        SchemaError: If the database is newer than this code or is not a ckstore index.
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    script = script_directory(script_location)
    try:
        display = _display_url(engine)
        with _schema_lock(engine) as conn:
            revision = _stored_revision(conn, display)
            if revision is not None and not _known(revision, script):
                raise SchemaError(_newer_message(revision, display))
            config = alembic_config(connection=conn, script_location=script_location)
            command.upgrade(config, "head")
            return MigrationContext.configure(conn).get_current_revision() or ""
    finally:
        engine.dispose()


def current_revision(engine: Engine) -> str | None:
    """Returns the revision stored in the database, or None for an empty database."""
    with engine.connect() as conn, conn.begin():
        return _stored_revision(conn, _display_url(engine))


@contextmanager
def _schema_lock(engine: Engine) -> Iterator[Connection]:
    """One write transaction that no other schema creator or upgrader runs beside."""
    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE already excludes other writers
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
        yield conn


def _stored_revision(conn: Connection, url: str) -> str | None:
    tables = set(inspect(conn).get_table_names())
    if VERSION_TABLE not in tables:
        if tables:
            raise SchemaError(
                f"{url} is not a ckstore index: it has tables ({', '.join(sorted(tables)[:5])}) "
                f"but no {VERSION_TABLE} table; point --index at an empty database or a "
                "ckstore index"
            )
        return None
    heads = [str(v) for v in conn.scalars(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    if len(heads) != 1:
        raise SchemaError(
            f"index {url} has {len(heads)} schema revisions recorded ({heads}); expected one. "
            "It is damaged or not a ckstore index."
        )
    return heads[0]


def _known(revision: str, script: ScriptDirectory) -> bool:
    return any(rev.revision == revision for rev in script.walk_revisions())


def _check_revision(revision: str, script: ScriptDirectory, url: str) -> None:
    head = script.get_current_head()
    if revision == head:
        return
    if not _known(revision, script):
        raise SchemaError(_newer_message(revision, url))
    raise SchemaError(
        f"index {url} has schema revision {revision}, older than this ckstore's {head}. "
        f"Upgrade it with: {migrate_command(url)} "
        "(stop the writers that still run the older ckstore first)"
    )


def _newer_message(revision: str, url: str) -> str:
    return (
        f"index {url} has schema revision {revision}, which this ckstore does not know: it was "
        "written by a newer ckstore. Upgrade ckstore (pip install -U ckstore) to open it."
    )


def _display_url(engine: Engine) -> str:
    return display_url(engine.url)
