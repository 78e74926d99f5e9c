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

from ..errors import DistributedError, InvalidInputError, RankLostError
from ..format.limits import check_number
from ._group import Group, open_group, take_number

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
        raise InvalidInputError(
            f"$CKSTORE_DIST_TIMEOUT must be a number of seconds, got {env!r}"
        ) from None
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
        members: instead of ``pg``, the global ranks taking part, in their rank order (what a
            caller knows when it is handed ranks but not the group, as DCP's storage layer is).

    Every collective returns or raises :class:`DistributedError` within the timeout (plus a
    few seconds to name the missing ranks); ``err.ranks`` lists them (group ranks).
    """

    def __init__(
        self,
        pg: ProcessGroup | None = None,
        timeout: float | None = None,
        purpose: str = "sync",
        members: list[int] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.timeout = dist_timeout(timeout)
        self._purpose = purpose
        self.members = [int(m) for m in members] if members is not None else members_of(pg)
        me = dist.get_rank()
        if me not in self.members:
            raise InvalidInputError(
                f"rank {me} is not in the process group passed as pg= ({self.members})"
            )
        self.rank = self.members.index(me)
        self.world = len(self.members)
        self._group = (
            open_group(self.members, self.rank, self.timeout, purpose) if self.world > 1 else None
        )
        self.number = 0
        """Which take of this process over these members and purpose this is (1, 2, ...;
        :meth:`count`), 0 if not counted: the ranks compare it in a take's plan phase."""

    def count(self) -> int:
        """Number this take among those of this process over the same members and purpose
        (an async take counts as it opens its group, before anything can fail on one rank)."""
        self.number = take_number(self.members, self._purpose)
        return self.number

    def enter(self, step: str) -> None:
        """Post the phase this rank is entering: a rank that stops or dies in it is named with it."""
        if self._group is not None:
            self._group.enter(step)

    @property
    def group(self) -> Group | None:
        """The gloo group under this communicator (None for one rank)."""
        return self._group

    def all_gather_json(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        raw = _encode(obj)
        if self._group is None:
            return [json.loads(raw)]
        g = self._group
        n = torch.tensor([len(raw)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        g.run(what, lambda: g.pg.allgather([sizes], [n]))
        longest = max(int(s) for s in sizes)
        mine = _padded(raw, longest)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        g.run(what, lambda: g.pg.allgather([bufs], [mine]))
        return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def all_reduce_max(self, values: list[int], what: str) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (int64; same length everywhere).

        O(len(values)) bytes per rank whatever the world size: what a flat protocol uses to
        agree (a failure flag; "is this the same on every rank": the maximum of ``x`` and of
        ``-x``).
        """
        if self._group is None or not values:
            return list(values)
        g = self._group
        t = torch.tensor(values, dtype=torch.int64)
        g.run(what, lambda: g.allreduce_max(t))
        return [int(x) for x in t.tolist()]

    def all_reduce_sum(self, values: list[int], what: str) -> list[int]:
        """The element-wise sum of every rank's ``values`` (int64, same length everywhere):
        O(len(values)) bytes per rank whatever the world size."""
        if self._group is None or not values:
            return list(values)
        g = self._group
        t = torch.tensor(values, dtype=torch.int64)
        g.run(what, lambda: g.allreduce(t, "sum"))
        return [int(x) for x in t.tolist()]

    def all_reduce_fsum(self, values: list[float], what: str) -> list[float]:
        """:meth:`all_reduce_sum` of float64 values."""
        if self._group is None or not values:
            return list(values)
        g = self._group
        t = torch.tensor(values, dtype=torch.float64)
        g.run(what, lambda: g.allreduce(t, "sum"))
        return [float(x) for x in t.tolist()]

    def gather_bytes(self, data: bytes, what: str, dst: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on rank ``dst``, exactly (in rank order); None elsewhere.

        Rank ``dst`` first gathers every rank's length (8 bytes each), then the bytes travel
        unpadded (an all-to-all where only ``dst`` receives): it receives the sum of the
        messages, not the world times the longest one.
        """
        if self._group is None:
            return [bytes(data)]
        g = self._group
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = (
            [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            if self.rank == dst
            else []
        )
        g.run(what, lambda: g.gather(sizes, n, dst))
        send_splits = [0] * self.world
        send_splits[dst] = len(data)
        recv_splits = [int(s) for s in sizes] if self.rank == dst else [0] * self.world
        send = _padded(data, len(data))
        recv = self.all_to_all(send, send_splits, recv_splits, what)
        if self.rank != dst:
            return None
        raw = recv.numpy().tobytes()
        out, at = [], 0
        for size in recv_splits:
            out.append(raw[at : at + size])
            at += size
        return out

    def gather_json(self, obj: Any, what: str, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (in rank order); None on the other ranks.

        The other ranks send their own message and receive nothing (one small all-reduce
        first agrees on the padded size).
        """
        raw = _encode(obj)
        if self._group is None:
            return [json.loads(raw)]
        g = self._group
        (longest,) = self.all_reduce_max([len(raw)], what)
        mine = _padded(_framed(raw), longest + 8)
        outs = (
            [torch.empty(longest + 8, dtype=torch.uint8) for _ in range(self.world)]
            if self.rank == dst
            else []
        )
        g.run(what, lambda: g.gather(outs, mine, dst))
        return [_unframe(o) for o in outs] if self.rank == dst else None

    def scatter_json(self, objs: list[Any] | None, what: str, src: int = 0) -> Any:
        """``objs[r]`` of rank ``src`` on each rank ``r`` (``objs`` is read on ``src`` only).

        Each rank receives only its own part (padded to the longest one).
        """
        if self._group is None:
            assert objs is not None
            return objs[0]
        g = self._group
        raws = [_framed(_encode(o)) for o in objs] if self.rank == src and objs is not None else []
        if self.rank == src and len(raws) != self.world:
            raise InvalidInputError(f"{what}: {len(raws)} parts for {self.world} ranks")
        n = torch.tensor([max((len(r) for r in raws), default=0)], dtype=torch.int64)
        g.run(what, lambda: g.broadcast(n, src))
        out = torch.empty(int(n), dtype=torch.uint8)
        ins = [_padded(r, int(n)) for r in raws]
        g.run(what, lambda: g.scatter(out, ins, src))
        return _unframe(out)

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], what: str
    ) -> torch.Tensor:
        """Raw bytes between every pair of ranks: rank ``r`` gets ``send_splits[r]`` bytes of
        this rank's ``send`` (a uint8 tensor, segments in rank order); returns what every rank
        sent here, ``recv_splits[r]`` bytes from rank ``r``, in rank order."""
        if self._group is None:
            return send[: send_splits[0]].clone()
        g = self._group
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8)
        g.run(what, lambda: g.alltoall(recv, send, recv_splits, send_splits))
        return recv

    def broadcast_json(self, obj: Any, what: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        raw = _encode(obj) if self.rank == src else b""
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

    def broadcast_bytes(self, data: bytes, what: str, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank (``data`` is read on ``src`` only)."""
        if self._group is None:
            return bytes(data)
        g = self._group
        n = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        g.run(what, lambda: g.broadcast(n, src))
        buf = _padded(data, int(n)) if self.rank == src else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            g.run(what, lambda: g.broadcast(buf, src))
        return buf.numpy().tobytes()

    def broadcast_tensors(
        self, tensors: list[torch.Tensor], what: str, src: int = 0, batch_bytes: int | None = None
    ) -> None:
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
                buf = (
                    torch.cat(pending)
                    if self.rank == src
                    else torch.empty(filled, dtype=torch.uint8)
                )
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


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _framed(raw: bytes) -> bytes:
    """``raw`` after its length (8 bytes, little-endian): a message in a padded buffer."""
    return len(raw).to_bytes(8, "little") + raw


def _unframe(buf: torch.Tensor) -> Any:
    data = buf.numpy().tobytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


def _padded(raw: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if raw:
        out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def failure(exc: BaseException) -> dict[str, Any]:
    """A JSON status for a rank that failed with ``exc``."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def raise_failed(
    statuses: list[dict[str, Any]], what: str, cause: BaseException | None = None
) -> None:
    """Raise one DistributedError naming every failed rank and its cause, if any failed."""
    failed = {r: str(s.get("error", "?")) for r, s in enumerate(statuses) if not s.get("ok")}
    if failed:
        causes = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise DistributedError(
            f"{what} failed on rank(s) {sorted(failed)}: {causes}", ranks=failed, causes=failed
        ) from cause


class Phase:
    """One phase of a collective operation, as seen by one rank (made by :func:`phase`).

    ``send(message)`` gives what the other ranks need from this one (JSON-able); after the
    ``with`` block, ``received`` holds every rank's message in rank order (``collect="all"``),
    the list on rank 0 and None elsewhere (``collect="root"``), nothing (``"none"``), or, for a
    phase with a ``root``, the root's message alone. ``send_max(values)`` (called on every
    rank, same length) gives ``maxed``, their element-wise maximum over the ranks.
    """

    def __init__(
        self,
        comm: Communicator | None,
        step: str,
        what: str,
        root: int | None,
        collect: str = "all",
    ) -> None:
        if collect not in COLLECT:
            raise InvalidInputError(f"phase collect must be one of {COLLECT}, got {collect!r}")
        self.comm, self.step, self.what, self.root, self.collect = comm, step, what, root, collect
        self._message: Any = None
        self._values: list[int] | None = None
        self.received: Any = None
        self.maxed: list[int] = []

    def send(self, message: Any) -> None:
        """What this rank reports when its part of the phase succeeds."""
        self._message = message

    def send_max(self, values: list[int]) -> None:
        """Ints to reduce by maximum over the ranks once every rank succeeded (``maxed``)."""
        self._values = list(values)

    def finish(self, exc: Exception | None) -> None:
        """Exchange outcomes; raise on every rank if any rank (or the root) failed."""
        if self.comm is None:
            if exc is not None:
                raise exc
            self.received = [self._message]
            self.maxed = list(self._values or [])
            return
        if self.root is not None:
            self._finish_root(self.comm, exc)
            return
        status = failure(exc) if exc is not None else {"ok": True, "message": self._message}
        if self.collect == "all":
            statuses = self.comm.all_gather_json(status, self.step)
            raise_failed(statuses, self.what, exc)
            self.received = [s["message"] for s in statuses]
        else:  # one small all-reduce says whether any rank failed; only then are causes gathered
            (failed,) = self.comm.all_reduce_max([int(exc is not None)], self.step)
            if failed:
                raise_failed(self.comm.all_gather_json(status, self.step), self.what, exc)
            if self.collect == "root":
                self.received = self.comm.gather_json(self._message, self.step)
        if self._values is not None:
            self.maxed = self.comm.all_reduce_max(self._values, self.step)

    def _finish_root(self, comm: Communicator, exc: Exception | None) -> None:
        status = failure(exc) if exc is not None else {"ok": True, "message": self._message}
        reply = comm.broadcast_json(
            status if comm.rank == self.root else None, self.step, src=self.root or 0
        )
        raise_failed([{"ok": True}] * (self.root or 0) + [reply], self.what, exc)
        if exc is not None:  # a rank other than the root failed where only the root works
            raise exc
        self.received = reply["message"]


COLLECT = ("all", "root", "none")


@contextmanager
def phase(
    comm: Communicator | None,
    step: str,
    what: str | None = None,
    *,
    root: int | None = None,
    collect: str = "all",
) -> Iterator[Phase]:
    """Run one rank's part of a collective phase, then tell every rank how every rank fared.

    Every phase of a distributed take, restore or DCP save goes through this: the rank posts
    the phase's name (``step``: a rank that stops or dies in it is named with it), the body
    runs this rank's part and ``send``s its message; on leaving the block the ranks exchange
    their outcomes, and if any rank's part raised an ``Exception``, every rank raises one
    :class:`DistributedError` naming the failed ranks and their causes (chained to this rank's
    own error). So no rank goes on to the next phase, or waits in it, after another gave up.

    Args:
        comm: the ranks' communicator; ``None`` for one process (the body's error propagates
            unchanged, ``received`` is ``[message]``).
        step: the phase's name ("plan", "read"): named when a rank never reaches it.
        what: what failed, for the error ("distributed take (plan)"); default ``step``.
        root: only this rank does the work; its outcome is broadcast to the others.
        collect: how messages travel when every rank succeeded: ``"all"`` (an all-gather of
            every rank's outcome and message: O(world) bytes per rank), ``"root"`` (messages
            gathered on rank 0 alone) or ``"none"``; with ``"root"`` and ``"none"`` the outcome
            is one all-reduced flag (O(1) per rank) and causes are gathered only on failure.
    """
    ph = Phase(comm, step, what or step, root, collect)
    if comm is not None:
        comm.enter(step)
    try:
        yield ph
    except RankLostError:
        raise  # a collective of the body failed: the group is closed, the error names the culprits
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        ph.finish(exc)  # raises: this rank failed
        raise
    ph.finish(None)
