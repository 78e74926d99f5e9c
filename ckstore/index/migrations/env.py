"""Alembic environment of the ckstore index (configuration is built in code, no alembic.ini).

The caller passes either an open connection (``config.attributes["connection"]``) or a URL
(``config.attributes["url"]``). SQLite migrations run in batch mode, since SQLite cannot alter
most things in place.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from ckstore.index.db import make_engine
from ckstore.index.models import metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        # one transaction for the whole upgrade or downgrade, on SQLite too (its engine emits
        # BEGIN itself, ``db.py``): a step that refuses leaves the index as it was
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.attributes["url"])
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=str(config.attributes["url"]), target_metadata=metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    _run_online()
