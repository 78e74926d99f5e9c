"""A take still running in the background: the handle ``async_take`` returns."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .engine.take.blocking import BlockingReport
from .format.manifest import Manifest
from .index import SnapshotRecord

if TYPE_CHECKING:
    from .snapshot import StoredSnapshot


class PendingSnapshot:
    """A take running in the background (TorchSnapshot's ``PendingSnapshot``).

    ``staged_bytes``: tensor bytes copied to finish in the background; ``sync_bytes``: bytes
    past the staging budget, stored before ``async_take`` returned; ``blocking``: how long the
    call blocked and why, and what another state size or budget would block for
    (:class:`~ckstore.engine.take.blocking.BlockingReport`; None for a distributed take).
    """

    def __init__(
        self,
        future: Future[Any],
        staged_bytes: int = 0,
        sync_bytes: int = 0,
        blocking: BlockingReport | None = None,
    ) -> None:
        self._future = future
        self.staged_bytes = staged_bytes
        self.sync_bytes = sync_bytes
        self.blocking = blocking

    @classmethod
    def of(
        cls,
        job: Future[tuple[SnapshotRecord, Manifest | None]],
        handle: Callable[[SnapshotRecord, Manifest | None], Any],
        staged_bytes: int = 0,
        sync_bytes: int = 0,
        blocking: BlockingReport | None = None,
    ) -> PendingSnapshot:
        """A background take whose committed ``(record, manifest)`` becomes ``handle(...)``."""
        future: Future[Any] = Future()

        def bind(done: Future[tuple[SnapshotRecord, Manifest | None]]) -> None:
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(handle(*done.result()))

        job.add_done_callback(bind)
        return cls(future, staged_bytes, sync_bytes, blocking)

    def done(self) -> bool:
        """True once the snapshot committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> StoredSnapshot:
        """Block until committed; return the snapshot or raise the take's error."""
        result: StoredSnapshot = self._future.result(timeout)
        return result
