"""What the engine needs of the parts it does not own: the index, and the ranks' communicator.

Each is a small :class:`~typing.Protocol` naming exactly the calls the engine makes, so a
reader sees the engine's dependencies here rather than in every signature, and mypy checks that
the real implementations (:class:`ckstore.index.Index`, :class:`ckstore.distributed.comm.Comm`)
provide them. Anything that has these methods will do: a test double, an index on another
database, a communicator over another transport.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..index import ChunkRecord, EntryRecord, PackRecord, SessionRecord, SnapshotRecord

if TYPE_CHECKING:
    import torch


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
    ) -> SnapshotRecord:
        """Commit the snapshot in one transaction (I1), recording ``packs`` (durable, not yet
        added) first; it exists iff this returns."""
        ...


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
