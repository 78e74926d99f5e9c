"""The store's ref verbs (git's ``tag`` and ``branch -D``): tags set, moved, listed and
deleted, and snapshots or whole runs forgotten.

:class:`RefVerbs` is mixed into :class:`ckstore.Store`; the work is in the index, one
transaction per verb. Forgetting a snapshot deletes its index rows only: its bytes stay until
``gc`` finds nothing else uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import CkstoreError, ConflictError, NotFoundError
from .index import SnapshotRecord, TagRecord

if TYPE_CHECKING:
    from .engine.repository import Repository
    from .snapshot import StoredSnapshot


MAX_PURGED = 1_000_000
"""How many chunk ids of its own deletions a store handle keeps for its next gc (about 100 MB)."""


class RefVerbs:
    """Tags and deletions of a store (docs/USAGE.md, "Refs and tags")."""

    _repo: Repository
    _purged: set[str]
    """Chunk ids of the snapshots this handle deleted since its last gc (see ``gc``)."""

    if TYPE_CHECKING:

        def get(self, ref: str) -> StoredSnapshot: ...  # Store's

    # --- tags -------------------------------------------------------------------------------
    def tag(self, ref: str, name: str, force: bool = False) -> StoredSnapshot:
        """Point tag ``name`` at ``ref``; moving an existing tag needs ``force=True``."""
        snap = self.get(ref)
        self._repo.index.set_tag(name, snap.id, force=force)
        return snap

    def untag(self, name: str) -> None:
        """Remove tag ``name`` (the snapshot stays)."""
        if self._repo.index.get_tag(name) is None:
            raise NotFoundError(f"no tag {name!r} in store {self._repo.url}")
        self._repo.index.delete_tag(name)

    def tags(self) -> dict[str, str]:
        """Tag name -> snapshot id."""
        return {t.name: t.snapshot_id for t in self.tag_records()}

    def tag_records(self) -> list[TagRecord]:
        """Every tag by name, with its snapshot's id, how often it moved (``version``) and
        when it last moved (``updated_at``)."""
        return self._repo.index.list_tags()

    # --- deletions ---------------------------------------------------------------------------
    def delete(self, ref: str, *, force: bool = False) -> None:
        """Forget one snapshot; its bytes are reclaimed by ``gc``.

        A ``gc`` of this handle reclaims what only the snapshots it deleted used without
        waiting for the grace period, when no write session is alive (a training job's purge
        frees its disk within the job).

        A tagged snapshot is kept unless ``force=True``, which deletes its tags with it.

        Raises:
            SnapshotNotFoundError: ``ref`` names nothing.
            ConflictError: the snapshot is tagged and ``force`` is False (the tags are named).
        """
        snap = self.get(ref)
        chunks = snap.manifest.chunk_ids()
        try:
            self._repo.index.delete_snapshot(snap.id, refuse_tagged=not force)
        except ConflictError as exc:
            tags = sorted(t.name for t in self._repo.index.list_tags(snap.id))
            raise ConflictError(
                f"snapshot {snap.ref} is tagged {', '.join(tags) or '(tags moved meanwhile)'}: "
                "untag it first (store.untag(name)), or pass force=True to delete it and its tags"
            ) from exc
        self._repo.deletion_ages.deleted([snap.id])  # what compaction after takes leaves loose
        self._remember_purged(chunks)

    def delete_run(self, run: str, *, force: bool = False) -> list[SnapshotRecord]:
        """Forget every snapshot of ``run``, and the run, in one transaction (all or nothing);
        their bytes are reclaimed by ``gc`` (:meth:`exclusive_bytes` says how much only this
        run uses).

        A run with a tagged snapshot is kept whole unless ``force=True``, which deletes the
        tags with the snapshots.

        Returns:
            The records of the snapshots forgotten, newest first.

        Raises:
            NotFoundError: ``run`` has no snapshot.
            ConflictError: a snapshot of the run is tagged and ``force`` is False (the tags are
                named); nothing was deleted.
        """
        gone = self._repo.index.delete_run(run, refuse_tagged=not force)
        for record in gone:
            try:
                self._remember_purged(self._repo.load_manifest(record).chunk_ids())
            except CkstoreError:
                continue  # a manifest unreadable here: its chunks wait for the grace period
        return gone

    def _remember_purged(self, chunks: set[str]) -> None:
        """Keep the chunk ids of a deletion for this handle's next gc (up to a bound: past it,
        they wait for the grace period like anyone's)."""
        if len(self._purged) + len(chunks) <= MAX_PURGED:
            self._purged |= chunks
