"""What an asynchronous take blocked its caller for, and what a take of another size would.

An ``async_take`` returns once the state at the call is safe. Within the staging budget that
means copied (at memory speed: a memcpy of those bytes); past it, stored (hashed, encoded and
written at the store's persist rate) before the call returns, as a synchronous take would. So
the blocking of a take of ``S`` bytes under a budget ``B`` is about::

    staged = min(S, B - reserved)      # reserved: the take's own buffers, out of the budget
    seconds = staged / copy_rate + (S - staged) / persist_rate

:class:`BlockingReport` is what ``PendingSnapshot.blocking`` holds: the figures of one call,
the rates they show, and :meth:`BlockingReport.predict` for another state size or budget.
Torch-free (the facade imports it when a store opens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BlockingReport:
    """How long one ``async_take`` blocked, and why.

    Attributes:
        staged_bytes: tensor bytes copied within the staging budget (stored in the background).
        sync_bytes: tensor bytes past the budget, stored before the call returned.
        budget: the staging budget of the call, in bytes.
        reserved_bytes: the part of the budget kept for the take's own buffers (its encode
            window: about ``2 * threads`` chunks), so that copies and buffers together stay
            within the budget.
        copy_seconds: time spent copying ``staged_bytes``.
        sync_seconds: time spent storing ``sync_bytes`` (0.0 when everything fitted).
        seconds: the whole call.
        persist_rate: bytes per second this process's takes into the store were last measured
            to store at in the foreground (hash, encode, write; the sync part of this call when
            it had one), or None before any was measured.
    """

    staged_bytes: int
    sync_bytes: int
    budget: int
    reserved_bytes: int
    copy_seconds: float
    sync_seconds: float
    seconds: float
    persist_rate: float | None

    @property
    def copy_rate(self) -> float | None:
        """Bytes per second the copy ran at (None when nothing was copied)."""
        return (
            self.staged_bytes / self.copy_seconds
            if self.staged_bytes and self.copy_seconds
            else None
        )

    def predict(self, state_bytes: int, budget: int | None = None) -> float | None:
        """The seconds an ``async_take`` of ``state_bytes`` tensor bytes would block under
        ``budget`` (default: this call's), at the rates this call measured (the module
        docstring's formula); None where a rate it needs is unknown.

        Tensors are staged whole while they fit, so the split is exact to within the largest
        tensor; the prediction leaves out the time to plan the take (milliseconds).
        """
        budget = self.budget if budget is None else budget
        staged = max(0, min(state_bytes, budget - self.reserved_bytes))
        rest = state_bytes - staged
        copy, persist = self.copy_rate, self.persist_rate
        if (staged and copy is None) or (rest and persist is None):
            return None
        return (staged / copy if staged and copy else 0.0) + (
            rest / persist if rest and persist else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        """The figures as a JSON-able dict (with ``copy_rate``)."""
        return {**asdict(self), "copy_rate": self.copy_rate}
