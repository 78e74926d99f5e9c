"""A gloo group of a process group's members, with arrival, heartbeat and culprit naming.

The transport under :class:`ckstore.distributed.comm.Comm`: each member posts ``here/<rank>``
in the job's rendezvous store and waits for the others; each collective first posts its
sequence number (``at/<rank>``); a daemon thread bumps ``beat/<rank>`` every second; when a
collective fails, the member posts ``left/<rank>`` and watches the others' keys to tell dead
or stopped ranks from ranks busy elsewhere (see the module docstring of ``comm``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..errors import DistributedError, RankLostError

BEAT_SECONDS = 1.0  # heartbeat period of an open group's members
STALL_CHECK_SECONDS = 3.0  # how long a heartbeat must stand still to count as stopped
_POLL_MAX = 0.05  # longest sleep between polls of the store while opening a group
_KEYS = ("at", "beat", "left")  # per-member keys: last collective reached, heartbeat, done
_INFO = ("phase", "prog")  # per-member keys: the phase it is in, its progress (see ``_progress``)

# (default group, members, timeout, purpose) -> the open group
_GROUPS: dict[tuple[Any, ...], Group] = {}


class Group:
    """A gloo group over ``members`` with its store keys (arrival, progress, heartbeat)."""

    def __init__(
        self, store: Any, members: list[int], rank: int, timeout: float, base: str
    ) -> None:
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
        self.report: Callable[[], str] | None = None  # this member's progress, posted with its beat
        try:
            self._arrive()
            try:
                self.pg: Any = dist.ProcessGroupGloo(
                    dist.PrefixStore(name + "/gloo/", store),
                    rank,
                    len(members),
                    timedelta(seconds=timeout),
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
        posted = ""
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                report = self.report
                now = report() if report is not None else ""
                if now != posted:
                    self.store.set(f"prog/{self.rank}", now)
                    posted = now
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return

    @property
    def generation(self) -> int:
        """The group's generation (the same on every member of this group)."""
        return self._gen

    def enter(self, step: str) -> None:
        """Post the phase this member is entering (named if it fails or stops in it)."""
        try:
            self.store.set(f"phase/{self.rank}", step)
        except Exception:  # noqa: BLE001 - the store is gone: the next collective says so
            pass

    def infos(self, key: str) -> list[str]:
        """Every member's ``phase`` or ``prog`` key, in member order ("" where unknown)."""
        try:
            return [
                v.decode()
                for v in self.store.multi_get([f"{key}/{r}" for r in range(len(self.members))])
            ]
        except Exception:  # noqa: BLE001 - the store is gone (rank 0 hosts it)
            return [""] * len(self.members)

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
            self.store.multi_set(
                [f"{k}/{self.rank}" for k in _KEYS + _INFO], ["0"] * len(_KEYS) + [""] * len(_INFO)
            )
            self.store.set(f"here/{self.rank}", "1")
            self.store.add("arrived", 1)
            deadline = time.monotonic() + self.timeout
            pause = 0.001
            while self.store.add("arrived", 0) < len(self.members):
                if time.monotonic() >= deadline:
                    absent = [
                        r for r in range(len(self.members)) if not self.store.check([f"here/{r}"])
                    ]
                    raise self._error(
                        what,
                        None,
                        [
                            (
                                absent,
                                "never arrived (dead, stopped, or busy in another call such as a barrier)",
                            )
                        ],
                    )
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store itself is gone (rank 0 died)
            raise self._error(what, exc, []) from exc

    # --- collectives (each returns gloo's Work; run them through :meth:`run`) ----------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def allreduce_max(self, tensor: torch.Tensor) -> Any:
        return self.allreduce(tensor, "max")

    def allreduce(self, tensor: torch.Tensor, op: str) -> Any:
        """Reduce ``tensor`` over the members in place: ``op`` "max" or "sum"."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        opts.reduceOp = reduce_op  # type: ignore[assignment]  # the enum value is what gloo takes
        return self.pg.allreduce([tensor], opts)

    def gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, root: int) -> Any:
        """``outs`` (one per member, on ``root`` only; else empty) receive every ``tensor``."""
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = root
        return self.pg.gather([outs] if self.rank == root else [], [tensor], opts)

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor], root: int) -> Any:
        """``out`` receives ``ins[rank]`` of ``root`` (``ins``: one per member, on root only)."""
        import torch.distributed as dist

        opts = dist.ScatterOptions()
        opts.rootRank = root
        return self.pg.scatter([out], [ins] if self.rank == root else [], opts)

    def alltoall(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> Any:
        """Member ``r`` gets ``send_splits[r]`` bytes of ``send`` (in member order); ``recv``
        holds what each member sent here, ``recv_splits[r]`` bytes from member ``r``."""
        import torch.distributed as dist

        return self.pg.alltoall_base(recv, send, recv_splits, send_splits, dist.AllToAllOptions())

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
        phases: dict[int, str] = {}  # the phase each watched rank posted last
        lost_store = False
        while waiting and time.monotonic() < until:
            try:
                raw = self.store.multi_get([f"{k}/{r}" for r in waiting for k in (*_KEYS, "phase")])
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 hosts it)
                lost_store = True
                break
            now = time.monotonic()
            for i, r in enumerate(list(waiting)):
                at[r], beat, left = (int(v) for v in raw[4 * i : 4 * i + 3])
                phases[r] = raw[4 * i + 3].decode()
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
            dead += [
                r
                for r in waiting
                if r in last and now - last[r][1] >= 2 * BEAT_SECONDS and at.get(r, 0) < self.seq
            ]
            waiting = []
        absent = [r for r in waiting if at.get(r, 0) < self.seq]
        return self._error(
            what,
            exc,
            [
                (sorted(dead), "stopped responding (dead or stopped)"),
                (absent, f"never reached {what} (alive, but in another call such as a barrier)"),
            ],
            phases,
        )

    def _error(
        self,
        what: str,
        exc: BaseException | None,
        culprits: list[tuple[list[int], str]],
        phases: dict[int, str] | None = None,
    ) -> RankLostError:
        """A RankLostError naming ``culprits`` (lists of ranks, each with how it failed), and the
        phase each was last in (``phases``, from the members' ``phase`` keys) when known."""
        whole = self.members == list(range(len(self.members)))
        parts = []
        for ranks, how in culprits:
            if ranks:
                glob = "" if whole else f" (global rank(s) {[self.members[r] for r in ranks]})"
                where = sorted({phases.get(r, "") for r in ranks} - {""}) if phases else []
                last = f", last in phase {', '.join(repr(p) for p in where)}" if where else ""
                parts.append(f"rank(s) {ranks}{glob} {how}{last}")
        who = "; ".join(parts) if parts else "could not tell which rank failed"
        cause = ""
        if exc is not None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            cause = f": {type(exc).__name__}: {text}"
        return RankLostError(
            f"rank {self.rank}: {what} failed (timeout {self.timeout:g} s); {who}{cause}",
            ranks=[r for ranks, _ in culprits for r in ranks],
            causes={r: how for ranks, how in culprits for r in ranks},
        )


def open_group(members: list[int], rank: int, timeout: float, purpose: str) -> Group:
    """The cached group of ``members`` for ``(timeout, purpose)``, opened on first use."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    key = (id(default), tuple(members), timeout, purpose)
    group = _GROUPS.get(key)
    if group is not None and not group.broken:
        return group
    for k in [k for k in _GROUPS if k[0] != id(default)]:
        _GROUPS.pop(k).close()  # groups of a destroyed default group
    digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()[
        :16
    ]
    group = Group(
        _store(timeout), members, rank, timeout, f"ckstore/{purpose}/{digest}/{timeout:g}"
    )
    _GROUPS[key] = group
    return group


def _forget(group: Group) -> None:
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


_NUMBERS: dict[tuple[tuple[int, ...], str], int] = {}
_NUMBERS_LOCK = threading.Lock()


def take_number(members: list[int], purpose: str) -> int:
    """The next number (1, 2, ...) of this process's takes over ``members`` for ``purpose``."""
    key = (tuple(members), purpose)
    with _NUMBERS_LOCK:
        _NUMBERS[key] = number = _NUMBERS.get(key, 0) + 1
    return number
