"""What the engine and the layers on it need of the parts they do not own: the index, by role,
and the ranks' communicator.

Each is a small :class:`~typing.Protocol` naming the calls its consumer makes, so a reader sees
a layer's dependencies here rather than in every signature, and mypy checks both sides: that
the real implementations (:class:`ckstore.index.Index`, :class:`ckstore.distributed.comm.Comm`)
provide them, and that each consumer calls nothing else. Anything that has these methods will
do: a test double, an index on another database, a communicator over another transport.

The index's roles (restic's ``Lister`` / ``LoaderUnpacked`` idea: no consumer is typed with the
whole index). Each method is declared in one role only; a consumer's role is the roles it is
made of plus what only it calls:

=================  ========================================================================
role               who holds it
=================  ========================================================================
LocationIndex      a restore (``engine/restore``), what reads a remote's chunks
LeaseIndex         a write session's heartbeat (``engine/lease``)
WriteIndex         a take (``engine/take``), the chunks a push or pull copies
HistoryIndex       what names snapshots (``remote/select``)
ReadIndex          diff (``history/diff``)
CheckIndex         ``history/check``
GcIndex            ``history/gc``
CompactIndex       ``history/compact`` and its plan
ReindexIndex       ``history/reindex``
UsageIndex         ``history/du``
RemoteIndex        a store's remotes: ``remote/config``, ``status``, ``uploader``, push and pull
TransferIndex      both ends of a push or pull (``remote/transfer``)
TierIndex          the two-tier store (``remote/twotier``, ``tier``, ``evict``, ``hydrate``)
ProofIndex         the tier remote's index, as eviction checks its word (``remote/evict``)
=================  ========================================================================

``InventoryIndex``, ``RepackIndex`` and ``PlaceIndex`` are parts of those roles; a push's
copier (``remote/copy``) holds ``InventoryIndex`` alone, to tell this store's packs from the
remote packs its evicted chunks point at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..index import (
    ChunkRecord,
    EntryRecord,
    PackRecord,
    RemoteRecord,
    SessionRecord,
    SnapshotRecord,
    TagRecord,
)

if TYPE_CHECKING:
    import torch

    from ..index import Index
    from ..index.records import PackUsage
    from ..index.sessions import HeldSession
    from ..index.usage import StoreUsage


class LocationIndex(Protocol):
    """Where stored chunks are: what a reader needs."""

    def chunk_locations(self, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """The rows of the chunks that exist (with the bases of their delta chains)."""
        ...


class LeaseIndex(Protocol):
    """Write sessions with a lease (reliability contract I4)."""

    def begin_session(self, owner: str, lease_seconds: float) -> SessionRecord:
        """A new active session whose lease runs ``lease_seconds`` from now."""
        ...

    def heartbeat(self, session_id: str, lease_seconds: float) -> None:
        """Extend the lease; raises LeaseExpiredError if it already ran out."""
        ...

    def end_session(self, session_id: str, state: str) -> None:
        """End the session (``"committed"`` or ``"aborted"``), dropping its pins."""
        ...


class WriteIndex(LocationIndex, LeaseIndex, Protocol):
    """Everything a take asks of the index: the dedup oracle and the commit point."""

    def lookup_chunks(self, session_id: str, chunk_ids: Iterable[str]) -> dict[str, ChunkRecord]:
        """The chunks the store has among ``chunk_ids``, pinned for the session."""
        ...

    def add_pack(self, session_id: str, pack: PackRecord, chunks: Sequence[ChunkRecord]) -> None:
        """Record a durable pack and the chunks in it (pinned for the session)."""
        ...

    def commit_snapshot(
        self,
        session_id: str,
        snapshot: SnapshotRecord,
        entries: Sequence[EntryRecord],
        chunk_ids: Iterable[str],
        manifest_size: int,
        tags: Sequence[str] = (),
        packs: Sequence[tuple[PackRecord, Sequence[ChunkRecord]]] = (),
        staged: str | None = None,
    ) -> SnapshotRecord:
        """Commit the snapshot in one transaction (I1), recording ``packs`` (durable, not yet
        added) first, the pins of session ``staged`` as its chunk references too; it exists
        iff this returns."""
        ...


class HistoryIndex(Protocol):
    """The history as recorded: snapshots by id, ref and run, their entries and chunks, tags."""

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """The snapshot with this exact id; raises SnapshotNotFoundError."""
        ...

    def resolve(self, ref: str) -> SnapshotRecord:
        """The snapshot a ref names (``run@step``, tag, name, run, id prefix)."""
        ...

    def list_snapshots(
        self, run: str | None = None, limit: int | None = None, *, healthy: bool = False
    ) -> list[SnapshotRecord]:
        """Snapshots newest first (of one run, if given)."""
        ...

    def list_runs(self) -> list[str]:
        """The runs that have snapshots, by name."""
        ...

    def entries(self, manifest_id: str) -> list[EntryRecord]:
        """A manifest's entries in commit order."""
        ...

    def snapshot_chunk_ids(self, snapshot_id: str) -> set[str]:
        """The chunks a snapshot references."""
        ...

    def stored_bytes(self, snapshot_id: str) -> int:
        """The stored size of the chunks a snapshot references."""
        ...

    def get_tag(self, name: str) -> TagRecord | None:
        """The tag, or None."""
        ...

    def list_tags(self, snapshot_id: str | None = None) -> list[TagRecord]:
        """Tags by name (only those at ``snapshot_id``, if given)."""
        ...


class ReadIndex(HistoryIndex, LocationIndex, Protocol):
    """What a reader of history needs: the history, and where its chunks are."""


class InventoryIndex(Protocol):
    """Every row the index holds, to compare with the objects the store lists."""

    def all_chunks(self) -> Iterator[ChunkRecord]:
        """Every chunk row."""
        ...

    def index_pack_ids(self) -> set[str]:
        """Every pack the index knows, by its row or by a chunk row naming it."""
        ...

    def pack_row_ids(self) -> set[str]:
        """The packs that have a row."""
        ...

    def index_manifest_ids(self, among: Iterable[str] | None = None) -> set[str]:
        """Every manifest row (of ``among``, if given)."""
        ...

    def remote_pack_ids(self) -> dict[str, str]:
        """Pack id -> remote, for the packs of a remote (what evicted chunks point at)."""
        ...


class RepackIndex(LocationIndex, Protocol):
    """Chunks moved out of packs, and the emptied packs retired, then their rows deleted."""

    def relocate_chunks(
        self,
        pack: PackRecord,
        moves: Sequence[ChunkRecord],
        old_pack_id: str,
        session_id: str | None = None,
    ) -> int:
        """Record ``pack`` and point the chunks still in ``old_pack_id`` at it (CAS per row)."""
        ...

    def retire_packs(self, pack_ids: Iterable[str], now: float | None = None) -> list[str]:
        """Mark the packs that hold no live chunk retired; the ids marked now."""
        ...

    def delete_retired_packs(
        self, retired_before: float, only: Iterable[str] | None = None
    ) -> list[str]:
        """Delete the rows of packs retired before the time; their ids (objects go after)."""
        ...


class CheckIndex(ReadIndex, InventoryIndex, Protocol):
    """What ``check`` reads (it writes nothing)."""

    def snapshots_using(self, chunk_ids: Iterable[str]) -> dict[str, set[str]]:
        """Chunk id -> the snapshots that reference it."""
        ...


class GcIndex(ReadIndex, InventoryIndex, RepackIndex, LeaseIndex, Protocol):
    """What ``gc`` asks: retention, expired sessions, unreferenced rows and their pruning, and
    a write session for the packs it rewrites."""

    def delete_snapshot(self, snapshot_id: str, *, refuse_tagged: bool = False) -> None:
        """Delete a snapshot, its chunk references and tags (rows are left for gc)."""
        ...

    def unpushed_to_tiers(self) -> set[str]:
        """The snapshots some tier remote does not hold yet (retention keeps them)."""
        ...

    def expire_sessions(
        self, now: float | None = None, purge_after: float = 86400.0, gone: Iterable[str] = ()
    ) -> int:
        """Mark sessions past their lease (or of processes ``gone``) expired, dropping their
        pins; how many."""
        ...

    def held_sessions(self) -> list[HeldSession]:
        """Sessions still marked active, with what they keep from gc."""
        ...

    def live_sessions(self, started_before: float | None = None) -> list[SessionRecord]:
        """Active sessions whose lease has not run out."""
        ...

    def unreferenced_chunks(
        self,
        cutoff: float,
        ignoring: Sequence[str] = (),
        sessions: Sequence[str] | None = None,
    ) -> list[ChunkRecord]:
        """Chunks older than ``cutoff`` nothing references (but ``ignoring``) or pins (of
        ``sessions`` only, if given): what a prune would delete (read only)."""
        ...

    def young_unreferenced(
        self,
        cutoff: float,
        ignoring: Sequence[str] = (),
        sessions: Sequence[str] | None = None,
    ) -> tuple[int, int, float | None]:
        """What the grace period keeps: count, stored bytes, newest time."""
        ...

    def shrink_log(self) -> None:
        """Give back the disk the database's write-ahead log holds (SQLite)."""
        ...

    def prune_chunks(self, cutoff: float, ids: Iterable[str] | None = None) -> list[ChunkRecord]:
        """Delete the unreferenced, unpinned chunk rows older than ``cutoff`` (of ``ids``, if
        given, whatever their age); them."""
        ...

    def prune_manifests(
        self, cutoff: float, dry_run: bool = False, ignoring: Sequence[str] = ()
    ) -> list[str]:
        """Delete (or list) the manifest rows no snapshot uses, older than ``cutoff``."""
        ...

    def pack_usage(self) -> list[PackUsage]:
        """Every pack row with its live chunks and bytes."""
        ...


class CompactIndex(HistoryIndex, WriteIndex, RepackIndex, Protocol):
    """What ``compact`` asks: the loose chunks, and their switch to dense packs."""

    def loose_chunks(self) -> list[ChunkRecord]:
        """The chunk rows in loose packs, in pack and offset order."""
        ...

    def referencing_snapshots(self, chunk_ids: Iterable[str]) -> set[str]:
        """The snapshots that reference any of ``chunk_ids``."""
        ...

    def dependents_of(self, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` some delta is stored against."""
        ...

    def rewrite_chunks(
        self, session_id: str, pack: PackRecord, moves: Sequence[tuple[ChunkRecord, str]]
    ) -> list[str]:
        """Record a dense pack and switch the rows still in their old packs to it."""
        ...


class PlaceIndex(Protocol):
    """Which database the index is (what tells two stores apart, and names one in messages)."""

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        ...


class ReindexIndex(HistoryIndex, WriteIndex, PlaceIndex, Protocol):
    """What ``reindex`` asks of the empty index it fills."""


class RemoteIndex(HistoryIndex, Protocol):
    """A store's remotes and which of its snapshots each holds."""

    @property
    def read_only(self) -> str | None:
        """Why the index refuses writes, or None."""
        ...

    def add_remote(self, remote: RemoteRecord) -> RemoteRecord:
        """Add a remote; raises ConflictError if the name is taken."""
        ...

    def get_remote(self, name: str) -> RemoteRecord | None:
        """The remote named ``name``, or None."""
        ...

    def list_remotes(self) -> list[RemoteRecord]:
        """Every remote, by name."""
        ...

    def record_remote_store_id(self, name: str, store_id: str) -> str | None:
        """Record the id of the store at the remote's URL unless one is (compare-and-set); the
        id recorded now (None: no such remote)."""
        ...

    def remote_used(self, name: str) -> bool:
        """Whether the remote was ever used (a store id, snapshots or evicted chunks held
        there): a missing one is then never created anew."""
        ...

    def set_remote_tier(self, name: str, tier: bool) -> None:
        """Mark (or unmark) a remote as the store's persistent tier."""
        ...

    def remote_holdings(self) -> dict[str, set[str]]:
        """Snapshot id -> the remotes known to hold it."""
        ...

    def mark_pushed(
        self, remote: str, snapshot_ids: Iterable[str], now: float | None = None
    ) -> None:
        """Record that ``remote`` holds these snapshots."""
        ...

    def unpushed(self, remote: str) -> list[SnapshotRecord]:
        """The snapshots ``remote`` is not known to hold, run by run in commit order."""
        ...


class TransferIndex(HistoryIndex, WriteIndex, PlaceIndex, Protocol):
    """Either end of a push or pull: the source is read and pinned, the destination written."""

    def set_tag(
        self,
        name: str,
        ref_snapshot_id: str,
        *,
        force: bool = False,
        expected_version: int | None = None,
    ) -> TagRecord:
        """Create or move a tag."""
        ...


class TierIndex(RemoteIndex, InventoryIndex, RepackIndex, LeaseIndex, Protocol):
    """The two-tier store: packs by use, and chunk rows pointed at the tier remote."""

    def local_packs_by_use(self) -> list[tuple[str, int, float]]:
        """Local live packs as ``(id, size, last used)``, least recently used first."""
        ...

    def touch_packs(self, used: Mapping[str, float]) -> None:
        """Record when reads last used these packs."""
        ...

    def chunks_in_packs(self, pack_ids: Iterable[str]) -> list[ChunkRecord]:
        """The chunk rows that live in these packs."""
        ...

    def snapshots_using(self, chunk_ids: Iterable[str]) -> dict[str, set[str]]:
        """Chunk id -> the snapshots that reference it (whom a missing remote pack fails)."""
        ...

    def pushed_chunk_ids(self, remote: str, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` a snapshot ``remote`` holds references."""
        ...

    def held_by(self, remote: str) -> set[str]:
        """Ids of the snapshots ``remote`` is recorded here to hold."""
        ...

    def unmark_pushed(self, remote: str, snapshot_ids: Iterable[str]) -> None:
        """Forget that ``remote`` holds these snapshots (it was found not to)."""
        ...

    def point_chunks_at_remote(
        self, remote: str, records: Sequence[ChunkRecord], expected: Mapping[str, str]
    ) -> list[str]:
        """Point chunk rows at the remote's places for them (one transaction); the ids."""
        ...


class ProofIndex(LocationIndex, Protocol):
    """The tier remote's index, asked before the local tier evicts on its word: which of this
    store's snapshots it holds, and the sizes of the packs it records."""

    def snapshot_ids(self, snapshot_ids: Iterable[str]) -> set[str]:
        """Those of ``snapshot_ids`` the index holds."""
        ...

    def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """Pack id -> its recorded size, for the packs among ``pack_ids`` with a row."""
        ...


class UsageIndex(Protocol):
    """Disk usage from the references alone (``ckstore du``)."""

    def usage(self) -> StoreUsage:
        """Usage per run, store-wide, and each run's exclusive bytes, in one transaction."""
        ...

    def exclusive_by_run(self) -> dict[str, int]:
        """Run -> stored bytes of the chunks only that run needs."""
        ...


if TYPE_CHECKING:

    def _plays_every_role(
        index: Index,
    ) -> tuple[
        CheckIndex,
        GcIndex,
        CompactIndex,
        ReindexIndex,
        TransferIndex,
        TierIndex,
        ProofIndex,
        UsageIndex,
    ]:
        """mypy's proof that the index plays every role (the others are parts of these)."""
        return index, index, index, index, index, index, index, index


class Communicator(Protocol):
    """This rank's view of the ranks taking part: its rank, their number, and collectives.

    Every collective is called by every rank, in the same order, and returns or raises
    within a bounded time. ``what`` labels the collective in errors ("never reached ...").
    """

    rank: int
    world: int

    def enter(self, step: str) -> None:
        """Note the phase this rank enters (named if the rank stops or dies in it)."""
        ...

    def all_gather_json(self, obj: Any, what: str) -> list[Any]:
        """Every rank's JSON-able ``obj``, in rank order."""
        ...

    def all_reduce_max(self, values: list[int], what: str) -> list[int]:
        """The element-wise maximum of every rank's ints (the same number on every rank)."""
        ...

    def gather_json(self, obj: Any, what: str, dst: int = 0) -> list[Any] | None:
        """Every rank's JSON-able ``obj`` on rank ``dst`` (rank order); None elsewhere."""
        ...

    def broadcast_json(self, obj: Any, what: str, src: int = 0) -> Any:
        """Rank ``src``'s JSON-able ``obj`` on every rank."""
        ...

    def broadcast_tensors(
        self, tensors: list[torch.Tensor], what: str, src: int = 0, batch_bytes: int | None = None
    ) -> None:
        """Copy rank ``src``'s contiguous CPU ``tensors`` into the same-shaped ones elsewhere."""
        ...
