"""The index: the dedup oracle and the commit point of a ckstore store.

Contract:

* Every method runs in its own short transaction and is atomic: it either does all it says or
  raises and changes nothing.
* An :class:`Index` may be shared by threads; several processes may open the same database.
  On SQLite every write transaction starts with ``BEGIN IMMEDIATE`` (writers queue, no lost
  updates); on PostgreSQL read-then-write paths lock rows or compare-and-swap.
* Chunks a writer relies on are pinned to its write session (lease) from the moment the index
  reports them, until the session commits or ends; GC must leave pinned chunks alone while the
  lease is valid. A writer whose lease has expired cannot pin or commit (LeaseExpiredError).
* Errors are ckstore errors: LeaseExpiredError, ConflictError, NotFoundError (and
  SnapshotNotFoundError), InvalidInputError, SchemaError, and IndexError_ for database failures.

:class:`Index` is its parts, each a subclass of :class:`~ckstore.index.base.IndexBase` (the
database, its transactions, read-only opening) with one job. Each consumer names the part it
uses by a role (``ckstore/engine/interfaces.py``), not this whole class.
"""

from __future__ import annotations

from ckstore.index.compaction import Compaction
from ckstore.index.deletions import Deletions
from ckstore.index.maintenance import Maintenance
from ckstore.index.reads import Reads
from ckstore.index.remote import Remotes
from ckstore.index.sessions import Sessions
from ckstore.index.settings import Settings
from ckstore.index.sharing import Sharing
from ckstore.index.tags import Tags
from ckstore.index.tiering import Tiering
from ckstore.index.usage import DiskUsage
from ckstore.index.writes import TakeWrites


class Index(
    Settings,
    Sessions,
    TakeWrites,
    Reads,
    Tags,
    Deletions,
    Maintenance,
    Compaction,
    Sharing,
    DiskUsage,
    Remotes,
    Tiering,
):
    """SQL index of one store (SQLite or PostgreSQL). Create it with :meth:`Index.open`.

    Its parts, by job:

    * :class:`~.settings.Settings`: store-wide settings (``get_meta``, ``set_meta``).
    * :class:`~.sessions.Sessions`: write sessions and their leases, and what gc asks of them.
    * :class:`~.writes.TakeWrites`: a take's dedup lookups, durable packs and commit.
    * :class:`~.reads.Reads`: snapshots by id, ref or run, their entries and chunks, and where
      chunks are.
    * :class:`~.tags.Tags`: tags set, moved, read and deleted.
    * :class:`~.deletions.Deletions`: a snapshot or a run deleted.
    * :class:`~.maintenance.Maintenance`: gc's and check's queries.
    * :class:`~.compaction.Compaction`: loose chunks and their switch to dense packs.
    * :class:`~.sharing.Sharing`: what snapshots share, for views.
    * :class:`~.usage.DiskUsage`: disk usage per run and store-wide (``du``).
    * :class:`~.remote.Remotes`: the remotes and what each holds.
    * :class:`~.tiering.Tiering`: the local tier's pack use and evicted chunk rows.
    """
