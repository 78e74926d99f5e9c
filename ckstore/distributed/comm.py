"""JSON messages between the ranks of a process group: no pickle, every wait bounded.

A :class:`Comm` talks over a gloo group of its own, built by the group's members alone from
the job's rendezvous store (``torch.distributed``'s default store): ranks outside ``pg`` never
take part, so a take on a sub-group cannot hang ranks that are busy elsewhere (in a barrier,
say). Every step is bounded by the timeout, and a failure names the ranks behind it:

* **Opening a group**: each member posts ``here/<rank>`` in the store, then waits (polling)
  for the others. Members that have not arrived by the timeout are named in the
  :class:`~ckstore.errors.RankLostError` ("rank(s) [2] never arrived").
* **Each collective**: before it starts, each member posts the collective's sequence number
  (``at/<rank>``), and gloo bounds the collective by the timeout. While a group is open, a
  daemon thread of each member bumps its heartbeat counter (``beat/<rank>``) every second.
* **When a collective fails** (a peer's connection dropped, or the timeout passed), the member
  posts ``left/<rank>`` and watches the others' keys until each has either left too (alive:
  it saw the failure) or stopped beating, or the timeout (counted from the collective's start)
  has passed: ranks whose heartbeat stopped are named as dead or stopped (a killed rank within
  about ``STALL_CHECK_SECONDS``), ranks still beating that never reached the collective as
  absent (busy in another call).

A group whose opening or collective failed is closed, and the first member to see that moves
the group's *generation* (a store counter) on; the next :class:`Comm` opens the group of the
current generation, so members that missed the failed group (absent then) and those that saw
it fail meet again in the same fresh one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DistributedError, InvalidInputError
from ..format.limits import check_number
from ._group import open_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..engine.interfaces import Communicator

DEFAULT_TIMEOUT = 600.0
BROADCAST_BATCH = 64 << 20  # default bytes per broadcast call when sending tensors
MAX_TIMEOUT = 7 * 86400.0


def dist_timeout(timeout: float | None) -> float:
    """The timeout in seconds: the argument, else ``CKSTORE_DIST_TIMEOUT``, else 600.

    Raises:
        InvalidInputError: not a finite number of seconds > 0 (at most a week).
    """
    if timeout is not None:
        return check_number("dist_timeout", timeout, 0.0, MAX_TIMEOUT, lo_open=True)
    env = os.environ.get("CKSTORE_DIST_TIMEOUT")
    if not env:
        return float(DEFAULT_TIMEOUT)
    try:
        value = float(env)
    except ValueError:
        raise InvalidInputError(f"$CKSTORE_DIST_TIMEOUT must be a number of seconds, got {env!r}") from None
    return check_number("$CKSTORE_DIST_TIMEOUT", value, 0.0, MAX_TIMEOUT, lo_open=True)


def members_of(pg: ProcessGroup | None) -> list[int]:
    """The global ranks of ``pg`` in group-rank order (``None``: every rank)."""
    import torch.distributed as dist

    if pg is None or pg is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidInputError(
            f"rank {dist.get_rank()} is not a member of the process group passed as pg=; "
            "call ckstore only on the group's members"
        )
    return [int(r) for r in dist.get_process_group_ranks(pg)]


class Comm:
    """This rank's view of a process group: its rank and size there, and JSON collectives.

    Args:
        pg: ``None`` (every rank) or a ``torch.distributed`` group; only its members call.
            ``rank`` and ``world`` are this process's rank and the size within ``pg``.
        timeout: seconds any step may wait for the others (default ``CKSTORE_DIST_TIMEOUT``
            or 600).
        purpose: a label keeping apart groups used at the same time by different threads (a
            background take beside a restore in the main thread).

    Every collective returns or raises :class:`DistributedError` within the timeout (plus a
    few seconds to name the missing ranks); ``err.ranks`` lists them (group ranks).
    """

    def __init__(self, pg: ProcessGroup | None = None, timeout: float | None = None, purpose: str = "sync") -> None:
        import torch.distributed as dist

        self.timeout = dist_timeout(timeout)
        self.members = members_of(pg)
        me = dist.get_rank()
        if me not in self.members:
            raise InvalidInputError(f"rank {me} is not in the process group passed as pg= ({self.members})")
        self.rank = self.members.index(me)
        self.world = len(self.members)
        self._group = open_group(self.members, self.rank, self.timeout, purpose) if self.world > 1 else None

    def all_gather_json(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        raw = json.dumps(obj, separators=(",", ":")).encode()
        if self._group is None:
            return [json.loads(raw)]
        g = self._group
        n = torch.tensor([len(raw)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        g.run(what, lambda: g.pg.allgather([sizes], [n]))
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if raw:
            mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        g.run(what, lambda: g.pg.allgather([bufs], [mine]))
        return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def broadcast_json(self, obj: Any, what: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        raw = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
        if self._group is None:
            return json.loads(raw)
        g = self._group
        n = torch.tensor([len(raw)], dtype=torch.int64)
        g.run(what, lambda: g.broadcast(n, src))
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == src and raw:
            buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        g.run(what, lambda: g.broadcast(buf, src))
        return json.loads(buf.numpy().tobytes())

    def broadcast_tensors(self, tensors: list[torch.Tensor], what: str, src: int = 0, batch_bytes: int | None = None) -> None:
        """Copy rank ``src``'s contiguous CPU ``tensors`` into the same-shaped ones elsewhere.

        Bytes travel in batches of at most ``batch_bytes``: small tensors are packed together
        into one buffer, large ones are sent in slices of their own storage (no copy).
        """
        if self._group is None:
            return
        g = self._group
        batch_bytes = batch_bytes or BROADCAST_BATCH
        pending: list[torch.Tensor] = []
        filled = 0

        def flush() -> None:
            nonlocal filled
            if len(pending) == 1:
                one = pending[0]
                g.run(what, lambda: g.broadcast(one, src))
            elif pending:
                buf = torch.cat(pending) if self.rank == src else torch.empty(filled, dtype=torch.uint8)
                g.run(what, lambda: g.broadcast(buf, src))
                if self.rank != src:
                    at = 0
                    for piece in pending:
                        piece.copy_(buf[at : at + piece.numel()])
                        at += piece.numel()
            pending.clear()
            filled = 0

        for t in tensors:
            if t.numel() == 0:
                continue
            flat = t.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), batch_bytes):
                piece = flat[start : start + batch_bytes]
                if filled + piece.numel() > batch_bytes:
                    flush()
                pending.append(piece)
                filled += piece.numel()
        flush()



def failure(exc: BaseException) -> dict[str, Any]:
    """A JSON status for a rank that failed with ``exc``."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def raise_failed(statuses: list[dict[str, Any]], what: str, cause: BaseException | None = None) -> None:
    """Raise one DistributedError naming every failed rank and its cause, if any failed."""
    failed = {r: str(s.get("error", "?")) for r, s in enumerate(statuses) if not s.get("ok")}
    if failed:
        causes = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise DistributedError(f"{what} failed on rank(s) {sorted(failed)}: {causes}", ranks=failed, causes=failed) from cause


class Phase:
    """One phase of a collective operation, as seen by one rank (made by :func:`phase`).

    ``send(message)`` gives what the other ranks need from this one (JSON-able); after the
    ``with`` block, ``received`` holds every rank's message in rank order, or, for a phase
    with a ``root``, the root's message alone.
    """

    def __init__(self, comm: Communicator | None, step: str, what: str, root: int | None) -> None:
        self.comm, self.step, self.what, self.root = comm, step, what, root
        self._message: Any = None
        self.received: Any = None

    def send(self, message: Any) -> None:
        """What this rank reports when its part of the phase succeeds."""
        self._message = message

    def finish(self, exc: Exception | None) -> None:
        """Exchange outcomes; raise on every rank if any rank (or the root) failed."""
        if self.comm is None:
            if exc is not None:
                raise exc
            self.received = [self._message]
            return
        status = failure(exc) if exc is not None else {"ok": True, "message": self._message}
        if self.root is None:
            statuses = self.comm.all_gather_json(status, self.step)
            raise_failed(statuses, self.what, exc)
            self.received = [s["message"] for s in statuses]
            return
        reply = self.comm.broadcast_json(status if self.comm.rank == self.root else None, self.step, src=self.root)
        raise_failed([{"ok": True}] * self.root + [reply], self.what, exc)
        if exc is not None:  # a rank other than the root failed where only the root works
            raise exc
        self.received = reply["message"]


@contextmanager
def phase(comm: Communicator | None, step: str, what: str | None = None, *, root: int | None = None) -> Iterator[Phase]:
    """Run one rank's part of a collective phase, then tell every rank how every rank fared.

    Every phase of a distributed take, restore or DCP save goes through this: the body runs
    this rank's part and ``send``s its message; on leaving the block the ranks exchange their
    outcomes (an all-gather, or with ``root`` a broadcast of the root's), and if any rank's
    part raised an ``Exception``, every rank raises one :class:`DistributedError` naming the
    failed ranks and their causes (chained to this rank's own error). So no rank goes on to
    the next phase, or waits in it, after another gave up.

    Args:
        comm: the ranks' communicator; ``None`` for one process (the body's error propagates
            unchanged, ``received`` is ``[message]``).
        step: the collective's label ("planning"): named when a rank never reaches it.
        what: what failed, for the error ("distributed take (planning)"); default ``step``.
        root: only this rank does the work; its outcome is broadcast to the others.
    """
    ph = Phase(comm, step, what or step, root)
    try:
        yield ph
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        ph.finish(exc)  # raises: this rank failed
        raise
    ph.finish(None)
