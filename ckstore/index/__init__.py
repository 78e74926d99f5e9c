"""The SQL index of a ckstore store: dedup oracle, commit point, refs and leases.

Works on SQLite and PostgreSQL. Never imports torch or the object layer. The names below load
on first use: the records and ``lite`` (a resume's reads on SQLite) import no SQLAlchemy,
which :class:`Index` and the schema functions do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckstore.index.records import (
    ChunkRecord,
    EntryRecord,
    PackRecord,
    RemoteRecord,
    SessionRecord,
    SnapshotRecord,
    TagRecord,
)

if TYPE_CHECKING:
    from ckstore.index.db import make_engine
    from ckstore.index.index import Index
    from ckstore.index.names import tag_specs, validate_name
    from ckstore.index.schema import current_revision, ensure_schema, head_revision, upgrade

_LAZY = {
    "Index": "index",
    "current_revision": "schema",
    "ensure_schema": "schema",
    "head_revision": "schema",
    "make_engine": "db",
    "tag_specs": "names",
    "upgrade": "schema",
    "validate_name": "names",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ckstore.index' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ChunkRecord",
    "EntryRecord",
    "Index",
    "PackRecord",
    "RemoteRecord",
    "SessionRecord",
    "SnapshotRecord",
    "TagRecord",
    "current_revision",
    "ensure_schema",
    "head_revision",
    "make_engine",
    "tag_specs",
    "upgrade",
    "validate_name",
]
