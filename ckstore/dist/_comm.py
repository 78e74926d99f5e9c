"""JSON messages between the ranks of a process group: no pickle, every wait bounded.

A :class:`Comm` talks over a gloo group of its own, built by the group's members alone from
the job's rendezvous store (``torch.distributed``'s default store): ranks outside ``pg`` never
take part, so a take on a sub-group cannot hang ranks that are busy elsewhere (in a barrier,
say). Every step is bounded by the timeout:

* **Opening a group**: each member posts ``here/<rank>`` in the store, then waits (polling)
  for the others. A member that has not arrived by the timeout is named in the
  :class:`DistributedError` ("rank(s) [2] never arrived").
* **Each collective**: before it starts, each member posts the collective's sequence number
  (``at/<rank>``); gloo bounds the collective itself by the timeout; while a member waits it
  bumps a heartbeat counter (``beat/<rank>``) about once a second. When a collective fails,
  the member reads those keys to name the culprits: ranks that never reached this collective
  (dead, stopped, or busy in another call), else ranks whose heartbeat stopped (dead or stopped
  mid-collective). Naming takes at most a few seconds more.

A group whose collective failed is dropped; the next :class:`Comm` opens a fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch

from ..errors import DistributedError, InvalidInputError, RankLostError

DEFAULT_TIMEOUT = 600.0
BROADCAST_BATCH = 64 << 20  # default bytes per broadcast call when sending tensors
BEAT_SECONDS = 1.0  # heartbeat period while waiting in a collective
STALL_CHECK_SECONDS = 2.5  # how long a heartbeat must stand still to count as stopped
_POLL_MAX = 0.05  # longest sleep between polls of a collective or of the store

# (default group, members, timeout, purpose) -> the open group; and how many were opened
_GROUPS: dict[tuple[Any, ...], _Group] = {}
_OPENED: dict[tuple[Any, ...], int] = {}


def dist_timeout(timeout: float | None) -> float:
    """The timeout in seconds: the argument, else ``CKSTORE_DIST_TIMEOUT``, else 600."""
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get("CKSTORE_DIST_TIMEOUT", DEFAULT_TIMEOUT))


def members_of(pg: Any) -> list[int]:
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

    def __init__(self, pg: Any = None, timeout: float | None = None, purpose: str = "sync") -> None:
        import torch.distributed as dist

        self.timeout = dist_timeout(timeout)
        self.members = members_of(pg)
        me = dist.get_rank()
        if me not in self.members:
            raise InvalidInputError(f"rank {me} is not in the process group passed as pg= ({self.members})")
        self.rank = self.members.index(me)
        self.world = len(self.members)
        self._group = _open(self.members, self.rank, self.timeout, purpose) if self.world > 1 else None

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


class _Group:
    """A gloo group over ``members`` with its store keys (arrival, progress, heartbeat)."""

    def __init__(self, store: Any, members: list[int], rank: int, timeout: float, name: str) -> None:
        import torch.distributed as dist

        self.members = members
        self.rank = rank
        self.timeout = timeout
        self.store = dist.PrefixStore(name + "/", store)
        self.seq = 0
        self.broken = False
        self._arrive()
        try:
            self.pg: Any = dist.ProcessGroupGloo(
                dist.PrefixStore(name + "/gloo/", store), rank, len(members), timedelta(seconds=timeout)
            )
        except Exception as exc:  # noqa: BLE001 - a peer vanished between arriving and connecting
            raise self._error("opening the ckstore process group", exc, []) from exc

    # --- opening ---------------------------------------------------------------------------
    def _arrive(self) -> None:
        """Post our arrival and wait for every member's, naming those that never came."""
        what = "opening the ckstore process group"
        try:
            self.store.set(f"here/{self.rank}", "1")
            waiting = [r for r in range(len(self.members)) if r != self.rank]
            deadline = time.monotonic() + self.timeout
            pause = 0.001
            while waiting:
                waiting = [r for r in waiting if not self.store.check([f"here/{r}"])]
                if not waiting:
                    break
                if time.monotonic() >= deadline:
                    err = self._error(what, None, waiting, "never arrived")
                    raise err
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store itself is gone (rank 0 died)
            raise self._error(what, exc, [], "") from exc

    # --- collectives -------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def run(self, what: str, start: Any) -> None:
        """Run one collective (``start()`` returns its Work) with progress keys and heartbeat."""
        if self.broken:
            raise DistributedError(
                f"rank {self.rank}: the ckstore process group failed earlier; {what} cannot run on it"
            )
        self.seq += 1
        try:
            self.store.set(f"at/{self.rank}", str(self.seq))
            work = start()
            self._wait(work)
        except Exception as exc:  # noqa: BLE001 - gloo: peer gone or timeout
            self.broken = True
            _forget(self)
            raise self._diagnose(what, exc) from exc

    def _wait(self, work: Any) -> None:
        """Wait for ``work``, bumping this rank's heartbeat about once a second."""
        pause = 0.0005
        beat = time.monotonic() + BEAT_SECONDS
        while not work.is_completed():
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
            if time.monotonic() >= beat:
                self.store.add(f"beat/{self.rank}", 1)
                beat = time.monotonic() + BEAT_SECONDS
        work.wait()

    # --- naming the culprits ---------------------------------------------------------------
    def _diagnose(self, what: str, exc: BaseException) -> RankLostError:
        """Name the ranks behind a failed collective: absent ones, else stalled ones."""
        others = [r for r in range(len(self.members)) if r != self.rank]
        try:
            behind = [r for r in others if self._at(r) < self.seq]
            if behind:
                return self._error(what, exc, behind, f"never reached {what}")
            first = {r: self._beat(r) for r in others}
            time.sleep(STALL_CHECK_SECONDS)
            stalled = [r for r in others if self._beat(r) == first[r] and self._at(r) == self.seq]
            return self._error(what, exc, stalled, f"stopped responding during {what}")
        except Exception:  # noqa: BLE001 - the store is gone too (rank 0 hosts it)
            return self._error(what, exc, [], "")

    def _at(self, r: int) -> int:
        return int(self.store.get(f"at/{r}")) if self.store.check([f"at/{r}"]) else 0

    def _beat(self, r: int) -> int:
        return int(self.store.get(f"beat/{r}")) if self.store.check([f"beat/{r}"]) else 0

    def _error(self, what: str, exc: BaseException | None, ranks: list[int], how: str = "") -> RankLostError:
        glob = [self.members[r] for r in ranks]
        if ranks:
            sub = "" if self.members == list(range(len(self.members))) else f" (global rank(s) {glob})"
            who = f"rank(s) {ranks}{sub} {how} (dead, stopped, or busy in another call such as a barrier)"
        else:
            who = "could not tell which rank failed"
        cause = ""
        if exc is not None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            cause = f": {type(exc).__name__}: {text}"
        err = RankLostError(f"rank {self.rank}: {what} failed (timeout {self.timeout:g} s); {who}{cause}")
        err.ranks = ranks  # type: ignore[attr-defined]
        err.causes = {r: how for r in ranks}  # type: ignore[attr-defined]
        return err


def _open(members: list[int], rank: int, timeout: float, purpose: str) -> _Group:
    """The cached group of ``members`` for ``(timeout, purpose)``, opened on first use."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    key = (id(default), tuple(members), timeout, purpose)
    group = _GROUPS.get(key)
    if group is not None and not group.broken:
        return group
    for k in [k for k in _GROUPS if k[0] != id(default)]:
        del _GROUPS[k]  # groups of a destroyed default group
    n = _OPENED.get(key, 0)
    _OPENED[key] = n + 1
    digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()[:16]
    name = f"ckstore/{purpose}/{digest}/{timeout:g}/{n}"
    group = _Group(_store(timeout), members, rank, timeout, name)
    _GROUPS[key] = group
    return group


def _forget(group: _Group) -> None:
    for k, g in list(_GROUPS.items()):
        if g is group:
            del _GROUPS[k]


def _store(timeout: float) -> Any:
    """A client of the job's rendezvous store whose own waits are bounded by ``timeout``."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    try:
        mine = store.clone()  # type: ignore[attr-defined]  # a connection of our own: its timeout is ours to set
        mine.set_timeout(timedelta(seconds=min(timeout, 60.0)))
        return mine
    except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore): share it
        return store


def failure(exc: BaseException) -> dict[str, Any]:
    """A JSON status for a rank that failed with ``exc``."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def raise_failed(statuses: list[dict[str, Any]], what: str) -> None:
    """Raise DistributedError naming every failed rank and its cause, if any failed."""
    failed = [(r, s.get("error", "?")) for r, s in enumerate(statuses) if not s.get("ok")]
    if failed:
        causes = "; ".join(f"rank {r}: {e}" for r, e in failed)
        ranks = [r for r, _ in failed]
        err = DistributedError(f"{what} failed on rank(s) {ranks}: {causes}")
        err.ranks = ranks  # type: ignore[attr-defined]
        err.causes = dict(failed)  # type: ignore[attr-defined]
        raise err
