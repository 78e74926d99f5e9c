"""The commit point of a take: store the manifest, then commit the snapshot in one transaction.

Torch-free, so ``reindex`` (which rebuilds index rows from stored manifests) uses the same
conversion as a take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ... import objects
from ...format.health import summary as health_summary
from ...format.manifest import Manifest, entry_digest
from ...format.parts import parted_digest
from ...index import ChunkRecord, EntryRecord, PackRecord, SnapshotRecord

if TYPE_CHECKING:
    from ..interfaces import WriteIndex


def entry_records(manifest: Manifest) -> list[EntryRecord]:
    """Index rows for a manifest's entries (kind, dtype, shape, size, digest); an entry that
    lived in parts gets the digest its take gave it (``parts.parted_digest``)."""
    return [
        EntryRecord(
            key,
            e.kind,
            e.dtype,
            e.shape,
            e.nbytes,
            parted_digest(e) if key in manifest.parted else entry_digest(e),
        )
        for key, e in manifest.entries.items()
    ]


def put_manifest(
    objs: objects.ObjectStore, manifest: Manifest, validate: bool = False
) -> tuple[bytes, str, bool]:
    """Store ``manifest`` as a blob (durable); its bytes, its id, and whether this call wrote
    it (False: found in place, see ``ObjectStore.store_blob``). Visible to nobody until a
    commit names it; if none does, GC removes it as an orphan.

    ``validate`` parses the serialised manifest back first (a manifest assembled from several
    ranks' pieces must tile every tensor), raising CorruptionError before anything is stored.
    """
    raw = manifest.to_json()
    if validate:
        Manifest.from_json(raw, "the manifest being committed")
    manifest_id, wrote = objs.store_blob("manifests", raw)
    return raw, manifest_id, wrote


def commit_manifest(
    index: WriteIndex,
    session: str,
    manifest: Manifest,
    stored: tuple[str, int],
    tags: Sequence[str],
    *,
    packs: Sequence[tuple[PackRecord, Sequence[ChunkRecord]]] = (),
    new_bytes: int,
    new_chunks: int,
    reused_chunks: int,
) -> SnapshotRecord:
    """Commit the snapshot of a stored ``manifest`` (``stored``: its id and size) in one index
    transaction, with ``tags`` moved to it.

    The snapshot id is the manifest id; the transaction records ``packs`` (durable packs the
    take did not index yet) and references every chunk the manifest names, so nothing it needs
    can be collected once it is visible (I1).
    """
    record = snapshot_record(
        manifest.snapshot or {},
        stored[0],
        manifest.logical_bytes(),
        new_bytes=new_bytes,
        new_chunks=new_chunks,
        reused_chunks=reused_chunks,
    )
    ids = sorted(manifest.referenced_ids())
    return index.commit_snapshot(
        session, record, entry_records(manifest), ids, stored[1], tuple(tags), packs
    )


def snapshot_record(
    header: dict[str, Any],
    manifest_id: str,
    logical_bytes: int,
    *,
    new_bytes: int,
    new_chunks: int,
    reused_chunks: int,
) -> SnapshotRecord:
    """The index record of a snapshot from its manifest's header (its parent is the commit's)."""
    nonfinite, stale, diverged = health_summary(header)
    return SnapshotRecord(
        id=manifest_id,
        run=header["run"],
        step=header.get("step"),
        parent_id=None,
        manifest_id=manifest_id,
        created_at=header["created_at"],
        metadata=dict(header.get("metadata") or {}),
        logical_bytes=logical_bytes,
        new_bytes=new_bytes,
        new_chunks=new_chunks,
        reused_chunks=reused_chunks,
        name=header.get("name"),
        world_size=int(header.get("world_size", 1)),
        nonfinite=nonfinite,
        stale=stale,
        diverged=diverged,
    )
