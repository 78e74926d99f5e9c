"""Frozen value types that cross the index boundary.

The index never hands out ORM objects: every method takes and returns these records, so callers
cannot keep a row alive past its transaction or mutate it behind the index's back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChunkRecord:
    """Where one chunk lives.

    Attributes:
        chunk_id: 64 hex digits, the hash of the chunk's raw (uncompressed) bytes.
        pack_id: Id of the pack object holding the chunk.
        offset: Byte offset of the stored (possibly compressed) chunk inside the pack.
        length: Stored length in the pack, in bytes.
        raw_length: Uncompressed length, in bytes.
        codec: Codec name used to store it (``"none"``, ``"zstd"``, ...).
        base_id: For a delta, the chunk its bytes are XORed against; None for a full chunk.
        depth: Links from this chunk down to the full chunk at the root of its chain.
        payload_digest: 32 hex digits, the XXH3-128 of the stored payload as its writer
            recorded it (readers check stored bytes with it without decoding them); None
            when unknown (a row rebuilt from the packs by reindex).
    """

    chunk_id: str
    pack_id: str
    offset: int
    length: int
    raw_length: int
    codec: str
    base_id: str | None = None
    depth: int = 0
    payload_digest: str | None = None


@dataclass(frozen=True)
class PackRecord:
    """One pack object.

    Attributes:
        pack_id: Id (object name) of the pack.
        size: Size of the pack object, in bytes.
        chunk_count: Number of chunks stored in it.
        created_at: Unix time the pack was made durable (0.0: let the index use "now").
        loose: written by a take with the fast codec (compaction rewrites its chunks densely
            once no newest snapshot of a run uses them).
    """

    pack_id: str
    size: int
    chunk_count: int
    created_at: float = 0.0
    loose: bool = False


@dataclass(frozen=True)
class EntryRecord:
    """One key of a manifest, as far as the index needs it (listing and diffs).

    Attributes:
        key: The flattened app_state key.
        kind: Entry kind (``"tensor"``, ``"inline"``, ...), defined by the manifest layer.
        dtype: Tensor dtype name, or None for non-tensors.
        shape: Global tensor shape, or None for non-tensors.
        nbytes: Logical size in bytes.
        digest: Hex hash of the entry's canonical JSON, computed by the caller; equal digests
            mean equal entries.
    """

    key: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    digest: str


@dataclass(frozen=True)
class SnapshotRecord:
    """A committed snapshot (the analogue of a git commit).

    Attributes:
        id: Snapshot id (unique, normally hex).
        run: Run name the snapshot belongs to.
        step: Training step, or None.
        parent_id: Previous snapshot of the same run at commit time (set by the index).
        manifest_id: Id of the manifest object.
        created_at: Unix time.
        metadata: JSON-able user metadata.
        logical_bytes: Total logical bytes of the state.
        new_bytes: Bytes written by this snapshot (not deduplicated).
        new_chunks: Chunks written by this snapshot.
        reused_chunks: Chunks reused from earlier snapshots.
        name: Optional unique snapshot name (e.g. a TorchSnapshot path).
        world_size: Number of ranks that wrote it.
        nonfinite: NaN and Inf elements the take counted in its tensors (0: healthy), or None
            when it recorded no health (taken before ckstore did, or with ``health=False``).
        stale: Tensors that should have changed since the run's previous snapshot and did
            not, or None when not checked (a run's first snapshot, a step that did not advance).
        diverged: Replicated tensors whose copies differed between ranks at the take, or None
            when no replicas were compared (a single-process take, or taken before ckstore did).
    """

    id: str
    run: str
    step: int | None
    parent_id: str | None
    manifest_id: str
    created_at: float
    metadata: dict[str, Any] = field(hash=False)
    logical_bytes: int
    new_bytes: int
    new_chunks: int
    reused_chunks: int
    name: str | None = None
    world_size: int = 1
    nonfinite: int | None = None
    stale: int | None = None
    diverged: int | None = None

    @property
    def healthy(self) -> bool | None:
        """True if the take found no NaN or Inf, no stale tensor and no replicas that
        disagree (what ``run@healthy`` rolls back to); False if it found any of them; None if
        it recorded no NaN/Inf counts (unknown) and nothing else against it."""
        if self.stale or self.diverged:
            return False
        return None if self.nonfinite is None else self.nonfinite == 0


@dataclass(frozen=True)
class TagRecord:
    """A named pointer to a snapshot.

    Attributes:
        name: Tag name.
        snapshot_id: Snapshot it points at.
        version: Incremented on every move; used for compare-and-swap.
        updated_at: Unix time of the last move.
    """

    name: str
    snapshot_id: str
    version: int
    updated_at: float


@dataclass(frozen=True)
class SessionRecord:
    """A write session (lease). GC leaves alone chunks pinned by an active, unexpired session.

    Attributes:
        id: Session id.
        owner: Free-form description of the writer (host, pid, rank).
        started_at: Unix time the session began.
        heartbeat_at: Unix time of the last heartbeat.
        expires_at: Unix time after which the lease is void.
        state: ``"active"``, ``"committed"`` or ``"aborted"``.
    """

    id: str
    owner: str
    started_at: float
    heartbeat_at: float
    expires_at: float
    state: str


@dataclass(frozen=True)
class RemoteRecord:
    """A remote of the store (index revision 0006): another store it pushes to and pulls from.

    Attributes:
        name: The remote's name (as git names remotes: ``origin``), see ``validate_name``.
        url: The remote store's URL (a local directory, ``s3://bucket/prefix``, ...).
        index: The remote's index URL, or None for its default (SQLite inside a local store).
        options: The fsspec storage options it is opened with (JSON-able).
        tier: Whether it is the store's persistent tier (``ckstore.open(..., push_to=...)``):
            retention keeps every snapshot it does not hold yet.
        created_at: Unix time it was added.
        store_id: The id of the store at ``url`` (its ``ckstore.json``), recorded when it was
            added or first opened (revision 0007); None until a store was found there. Every
            open checks it: a store with another id is not this remote.
    """

    name: str
    url: str
    index: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    tier: bool = False
    created_at: float = 0.0
    store_id: str | None = None


@dataclass(frozen=True)
class PackUsage:
    """How much of a pack is still referenced by chunk rows."""

    pack_id: str
    size: int
    chunk_count: int
    created_at: float
    retired_at: float | None
    live_chunks: int
    live_bytes: int
    loose: bool = False
    remote: str | None = None
    """A pack of this remote (evicted chunks point at it), not of the store (revision 0006)."""
