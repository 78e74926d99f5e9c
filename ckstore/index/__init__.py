"""The SQL index of a ckstore store: dedup oracle, commit point, refs and leases.

Works on SQLite and PostgreSQL. Never imports torch or the object layer.
"""

from ckstore.index._refnames import tag_specs
from ckstore.index.db import make_engine
from ckstore.index.index import Index
from ckstore.index.names import validate_name
from ckstore.index.records import (
    ChunkRecord,
    EntryRecord,
    PackRecord,
    RemoteRecord,
    SessionRecord,
    SnapshotRecord,
    TagRecord,
)
from ckstore.index.schema import current_revision, ensure_schema, head_revision, upgrade

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
