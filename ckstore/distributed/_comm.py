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

import hashlib
import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from ..errors import DistributedError, InvalidInputError, RankLostError
from ..format.limits import check_number

DEFAULT_TIMEOUT = 600.0
BROADCAST_BATCH = 64 << 20  # default bytes per broadcast call when sending tensors
MAX_TIMEOUT = 7 * 86400.0
BEAT_SECONDS = 1.0  # heartbeat period of an open group's members
STALL_CHECK_SECONDS = 3.0  # how long a heartbeat must stand still to count as stopped
_POLL_MAX = 0.05  # longest sleep between polls of the store while opening a group
_KEYS = ("at", "beat", "left")  # per-member keys: last collective reached, heartbeat, done

# (default group, members, timeout, purpose) -> the open group
_GROUPS: dict[tuple[Any, ...], _Group] = {}


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

    def __init__(self, store: Any, members: list[int], rank: int, timeout: float, base: str) -> None:
        import torch.distributed as dist

        self.members = members
        self.rank = rank
        self.timeout = timeout
        # The generation: every member reads the current one, and the first member to see a
        # group of it fail moves it on, so members that missed that group (absent then) and
        # those that saw it fail still open the same next one.
        self._raw = store
        self._gen_key = f"{base}/generation"
        self._gen = int(store.add(self._gen_key, 0))
        name = f"{base}/{self._gen}"
        self.store: Any = dist.PrefixStore(name + "/", store)
        self.seq = 0
        self.broken = False
        try:
            self._arrive()
            try:
                self.pg: Any = dist.ProcessGroupGloo(
                    dist.PrefixStore(name + "/gloo/", store), rank, len(members), timedelta(seconds=timeout)
                )
            except Exception as exc:  # noqa: BLE001 - a peer vanished between arriving and connecting
                raise self._error("opening the ckstore process group", exc, []) from exc
        except BaseException:
            self._next_generation()
            raise
        self._stop = threading.Event()
        threading.Thread(target=self._beat_loop, name="ckstore-heartbeat", daemon=True).start()

    def _beat_loop(self) -> None:
        """Bump this member's heartbeat every second until the group closes."""
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return

    def close(self) -> None:
        """Stop the heartbeat and post ``left/<rank>`` (alive, but done with the group)."""
        self.broken = True
        if not self._stop.is_set():
            self._stop.set()
            self._leave()

    def _next_generation(self) -> None:
        """Move the generation on from this group's (once, whoever comes first)."""
        try:
            self._raw.compare_set(self._gen_key, str(self._gen), str(self._gen + 1))
        except Exception:  # noqa: BLE001 - the store is gone: no group can open anyway
            pass

    def _leave(self) -> None:
        try:
            self.store.set(f"left/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to ask
            pass

    # --- opening ---------------------------------------------------------------------------
    def _arrive(self) -> None:
        """Post our arrival and wait for every member's, naming those that never came.

        Each member first creates its ``at``, ``beat`` and ``left`` keys (so later reads of
        them never wait), then counts itself in; waiting polls one counter.
        """
        what = "opening the ckstore process group"
        try:
            self.store.multi_set([f"{k}/{self.rank}" for k in _KEYS], ["0"] * len(_KEYS))
            self.store.set(f"here/{self.rank}", "1")
            self.store.add("arrived", 1)
            deadline = time.monotonic() + self.timeout
            pause = 0.001
            while self.store.add("arrived", 0) < len(self.members):
                if time.monotonic() >= deadline:
                    absent = [r for r in range(len(self.members)) if not self.store.check([f"here/{r}"])]
                    raise self._error(what, None, [(absent, "never arrived (dead, stopped, or busy in another call such as a barrier)")])
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store itself is gone (rank 0 died)
            raise self._error(what, exc, []) from exc

    # --- collectives -------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def run(self, what: str, start: Any) -> None:
        """Run one collective (``start()`` returns its Work), naming the culprits if it fails."""
        if self.broken:
            raise DistributedError(
                f"rank {self.rank}: the ckstore process group failed earlier; {what} cannot run on it"
            )
        self.seq += 1
        began = time.monotonic()
        try:
            self.store.set(f"at/{self.rank}", str(self.seq))
            start().wait()
        except Exception as exc:  # noqa: BLE001 - gloo: peer gone or timeout
            self.broken = True
            _forget(self)
            self._next_generation()
            err = self._diagnose(what, exc, began + self.timeout)  # still beating meanwhile
            self.close()
            raise err from exc

    # --- naming the culprits ---------------------------------------------------------------
    def _diagnose(self, what: str, exc: BaseException, deadline: float) -> RankLostError:
        """Watch the others' keys to tell which ranks caused a failed collective.

        This rank first posts ``left/<rank>`` (alive, failed here). Another rank resolves as
        soon as it is seen to have left (alive: it failed too, or closed the group) or its
        heartbeat has stood still for ``STALL_CHECK_SECONDS`` (dead or stopped). Watching ends
        when every rank resolved, or once the collective's deadline has passed and every rank
        left has been seen beating (at the latest ``STALL_CHECK_SECONDS`` after it); ranks still
        beating then that never reached this collective are named as absent. One ``multi_get`` per tick reads every key watched.
        If the store goes away meanwhile (its host, rank 0, exited), what was seen so far is
        reported.
        """
        waiting = [r for r in range(len(self.members)) if r != self.rank]
        self._leave()
        began = time.monotonic()
        until = max(deadline, began + STALL_CHECK_SECONDS + 0.5)
        last: dict[int, tuple[int, float]] = {}
        at: dict[int, int] = {}
        dead: list[int] = []
        alive: set[int] = set()
        lost_store = False
        while waiting and time.monotonic() < until:
            try:
                raw = self.store.multi_get([f"{k}/{r}" for r in waiting for k in _KEYS])
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 hosts it)
                lost_store = True
                break
            now = time.monotonic()
            for i, r in enumerate(list(waiting)):
                at[r], beat, left = (int(v) for v in raw[3 * i : 3 * i + 3])
                if left:
                    waiting.remove(r)  # alive: it failed here too, or is done with the group
                elif r not in last or beat != last[r][0]:
                    if r in last:
                        alive.add(r)  # seen beating since the failure
                    last[r] = (beat, now)
                elif now - last[r][1] >= STALL_CHECK_SECONDS:
                    waiting.remove(r)
                    dead.append(r)
            if now >= deadline and alive.issuperset(waiting):
                break  # the timeout has passed and everyone left is alive elsewhere
            time.sleep(0.25)
        if lost_store:  # judge by what was seen: beats standing still for two periods or more
            now = time.monotonic()
            dead += [r for r in waiting if r in last and now - last[r][1] >= 2 * BEAT_SECONDS and at.get(r, 0) < self.seq]
            waiting = []
        absent = [r for r in waiting if at.get(r, 0) < self.seq]
        return self._error(what, exc, [(sorted(dead), "stopped responding (dead or stopped)"), (absent, f"never reached {what} (alive, but in another call such as a barrier)")])

    def _error(self, what: str, exc: BaseException | None, culprits: list[tuple[list[int], str]]) -> RankLostError:
        """A RankLostError naming ``culprits`` (lists of ranks, each with how it failed)."""
        whole = self.members == list(range(len(self.members)))
        parts = []
        for ranks, how in culprits:
            if ranks:
                glob = "" if whole else f" (global rank(s) {[self.members[r] for r in ranks]})"
                parts.append(f"rank(s) {ranks}{glob} {how}")
        who = "; ".join(parts) if parts else "could not tell which rank failed"
        cause = ""
        if exc is not None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            cause = f": {type(exc).__name__}: {text}"
        err = RankLostError(f"rank {self.rank}: {what} failed (timeout {self.timeout:g} s); {who}{cause}")
        err.ranks = sorted(r for ranks, _ in culprits for r in ranks)  # type: ignore[attr-defined]
        err.causes = {r: how for ranks, how in culprits for r in ranks}  # type: ignore[attr-defined]
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
        _GROUPS.pop(k).close()  # groups of a destroyed default group
    digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()[:16]
    group = _Group(_store(timeout), members, rank, timeout, f"ckstore/{purpose}/{digest}/{timeout:g}")
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
