"""Damaged local chunks healed from a remote: ``Store.repair``, and the reads' own healing.

:class:`HealVerbs` is mixed into :class:`ckstore.Store`; :func:`healing` gives every read of a
snapshot (``restore``, ``read_object``, ``get_state_dict_for_key``, ``export``) a
:class:`RestoreHealer`, which heals the chunks its fetcher finds damaged while it runs;
:func:`heal_restore` is what a restore that still failed calls before it gives up. The work is
in :mod:`ckstore.remote.heal`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .engine.locations import to_location
from .errors import CorruptionError, HealedWarning, ObjectNotFoundError, warn

# ``history.check`` and ``remote.heal`` are imported where a repair or a heal runs: every read
# makes a RestoreHealer, and a read that meets no damage (a resume) loads neither.
if TYPE_CHECKING:
    from .engine.repository import Repository
    from .engine.restore.sources import Healed
    from .engine.view import SnapshotView
    from .history.check import CheckReport
    from .index import RemoteRecord
    from .remote.heal import Fetched, HealReport

MAX_NAMED = 8
"""Chunks and keys a message names (the report holds them all)."""


@dataclass
class RepairReport:
    """What :meth:`HealVerbs.repair` found and did: the chunks healed (id -> remote), those
    no remote could give back, and the check after the repair (``ok``: nothing stays damaged)."""

    healed: dict[str, str] = field(default_factory=dict)
    unrecoverable: list[str] = field(default_factory=list)
    check: CheckReport = field(default_factory=lambda: _check_report())
    unreachable: dict[str, str] = field(default_factory=dict)
    """Remotes that could not be opened or read (name -> why)."""

    @property
    def ok(self) -> bool:
        return self.check.ok and not self.unrecoverable

    def to_dict(self) -> dict[str, Any]:
        return {
            "healed": dict(self.healed),
            "unrecoverable": list(self.unrecoverable),
            "unreachable": dict(self.unreachable),
            "problems": [p.message for p in self.check.problems],
            "ok": self.ok,
        }


class HealVerbs:
    """``repair``: every damaged local chunk brought back from a remote that holds it."""

    _repo: Repository

    def repair(
        self,
        remote: str | None = None,
        progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    ) -> RepairReport:
        """Read every chunk of the store (as ``check(read_data=True)``), heal each damaged one
        from ``remote`` (None: any configured remote that holds it; a two-tier store's tier
        remote is one), verified against its id and written into a new local pack, then check
        again.

        Returns:
            A :class:`RepairReport`: ``healed`` (chunk id -> remote), ``unrecoverable`` (no
            remote that could be read holds a sound copy), ``unreachable`` (remotes that could
            not be opened or read, name -> why), and the check after the repair; ``ok`` is
            False when anything stays damaged.

        Raises:
            NotFoundError: ``remote`` is named and not configured.
            ReadOnlyStoreError: the store is open read-only and a chunk needs healing.
        """
        from .history.check import check as history_check
        from .remote.heal import damaged, heal

        before = history_check(self._repo, read_data=True, progress=progress)
        suspects = _suspects(self._repo, before)
        healed = heal(self._repo, damaged(self._repo, suspects), remote)
        after = before if not suspects else history_check(self._repo, read_data=True)
        return RepairReport(
            dict(healed.healed), list(healed.unrecoverable), after, dict(healed.unreachable)
        )


def _check_report() -> CheckReport:
    from .history.check import CheckReport

    return CheckReport()


def _suspects(repo: Repository, report: CheckReport) -> set[str]:
    """The chunks a check's problems name: the chunk itself, or every chunk of a pack named."""
    chunks = {c.chunk_id: c.pack_id for c in repo.index.all_chunks()}
    packs = {p.object for p in report.problems}
    return {c for c, pack in chunks.items() if c in packs or pack in packs}


@contextmanager
def healing(view: SnapshotView, budget: int | None = None) -> Iterator[SnapshotView]:
    """A copy of ``view`` for one read call (a restore, ``read_object``, ...) whose readers
    (``Reader.of``) heal as they read: a chunk found damaged or missing goes to one
    :class:`RestoreHealer` for the whole call (``budget``: the bytes of healed chunks it may
    hold, None: the store's ``memory_budget``), and after the call, whether it succeeded or
    not, :class:`HealedWarning` names what was healed, once (every heal is counted). Damage
    it could not heal raises as the read raised it, naming the remotes that could not be
    opened or read. The one path every read of a snapshot heals through."""
    healer = RestoreHealer(view, budget)
    try:
        yield view.healing_with(healer)
    except (CorruptionError, ObjectNotFoundError) as exc:
        said = _unreachable(healer.unreachable)
        if not said or said in str(exc):
            raise
        raise type(exc)(f"{exc}; {said}") from exc
    finally:
        healer.report()


class RestoreHealer:
    """A read's :data:`~ckstore.engine.restore.fetch.Healer`: a chunk its fetcher found
    damaged or missing is fetched from a configured remote that holds it, verified against its
    id, while the read goes on; :meth:`report` warns once after.

    A whole chunk (no delta chain) is fetched on the fetcher's thread that asked (threads
    fetch in parallel, each chunk once) and handed over as its verified bytes, used at once.
    Writing what the call fetched back into this store (one new durable pack, the rows switched
    by compare-and-swap) is handed to the store handle's write-back thread when the call ends
    (:class:`~ckstore.engine.write_backs.WriteBacks`, awaited at close and by whatever relies
    on the local copies): the read never waits for a pack, an fsync or the index's write lock.
    Memory: the healed bytes a call holds are at most ``budget`` (the read's memory budget,
    held beside its staging arena): the healer keeps them until the call ends (a chunk asked
    again gets them again), the write-back until it lands. Past the budget, and for a delta
    whose chain holds a damaged link, the synchronous path runs: the heal is written here
    before the fetcher reads the chunk again at its new place.

    The synchronous path's heals are group commits: one runs at a time, and the chunks other
    threads found damaged meanwhile wait and are then healed together (one query per remote,
    one new pack, one row switch per old pack). A remote that cannot be opened or read is
    tried once per call, not once per chunk."""

    def __init__(self, view: SnapshotView, budget: int | None = None) -> None:
        self.view = view
        self.healed: dict[str, str] = {}
        self.unreachable: dict[str, str] = {}
        """Remotes that could not be opened or read during the call (name -> why)."""
        self.room = view.repo.memory_budget if budget is None else budget
        """Bytes of healed chunks this call may still hold in memory (None: no limit)."""
        self._lock = threading.Lock()  # one heal at a time
        self._queued: set[str] = set()  # found damaged, waiting for the next heal
        self._outcome: dict[str, Healed] = {}  # of chunks a heal took, until their caller asks
        self._queue_lock = threading.Lock()
        self._passed_over: set[str] = set()
        self._sound: set[str] = set()  # damaged links found sound again once others healed
        self._given: dict[str, memoryview] = {}  # healed bytes handed over, for the call's life
        self._remotes: list[RemoteRecord] | None = None  # the configured ones, once looked up
        self._fetching: dict[str, threading.Event] = {}  # whole chunks being handed over
        self._fetched: list[Fetched] = []  # handed over, to write back once the read is over

    def __call__(self, chunk_id: str) -> Healed:
        handed = self._hand_over(chunk_id)
        if handed is not None:
            return handed
        with self._queue_lock:
            self._queued.add(chunk_id)
        with self._lock:
            with self._queue_lock:
                found = self._outcome.pop(chunk_id, None)
                if found is None:  # no heal took it yet: this one takes it, and all waiting
                    batch, self._queued = self._queued | {chunk_id}, set()
            if found is not None:
                return found
            outcome = self._heal(sorted(batch))
            with self._queue_lock:
                self._outcome.update(outcome)
                return self._outcome.pop(chunk_id)

    def _hand_over(self, cid: str) -> Healed | None:
        """Fetch a whole chunk and hand its verified bytes over, its write-back behind the read
        (on the caller's thread: the fetcher's threads fetch in parallel; one chunk asked by
        two threads is fetched once). False when no remote gives it back; None when it is not
        for this path (a delta, past the room left, or a chunk an earlier read of this handle
        healed: the fetcher may have located it before that write-back landed): the synchronous
        path takes it."""
        repo = self.view.repo
        with self._queue_lock:
            if self._remotes is None:  # asked once per call
                self._remotes = [] if repo.read_only else repo.index.list_remotes()
            if not self._remotes:
                return None
            if cid in self._given:
                return self._given[cid]
            busy = self._fetching.get(cid)
            if busy is None:
                self._fetching[cid] = threading.Event()
        if busy is not None:  # another thread fetches it: its outcome is this one's
            busy.wait()
            with self._queue_lock:
                return self._given.get(cid)
        try:
            return self._fetch_one(cid, self._remotes)
        finally:
            with self._queue_lock:
                self._fetching.pop(cid).set()

    def _fetch_one(
        self, cid: str, remotes: list[RemoteRecord], again: bool = False
    ) -> Healed | None:
        repo = self.view.repo
        if not again and repo.write_backs.submitted([cid]):
            return None  # an earlier read healed it: the synchronous path looks first
        rows = repo.index.chunk_locations([cid])
        rec = rows.get(cid)
        if rec is None or rec.base_id is not None:
            return None  # a delta: the synchronous path heals its damaged links
        with self._queue_lock:  # the room is reserved before the fetch, refunded if unused
            if self.room is not None and rec.raw_length > self.room:
                return None
            if self.room is not None:
                self.room -= rec.raw_length
        from .remote.heal import Known, fetch

        got = fetch(repo, [cid], self._passed_over, None, Known(remotes, rows))
        raw = got.raw.get(cid)
        with self._queue_lock:
            self.unreachable.update(got.report.unreachable)
            if raw is None:
                if self.room is not None:
                    self.room += rec.raw_length
                return False
            self._given[cid] = raw
            self.healed.update(got.report.healed)
            self._fetched.append(got)
        return raw

    def _heal(self, chunk_ids: list[str]) -> dict[str, Healed]:
        """The synchronous heal: each chunk's outcome (its bytes when handed over meanwhile,
        else whether it can be read again here)."""
        repo = self.view.repo
        if not self._remotes:
            return dict.fromkeys(chunk_ids, False)
        with self._queue_lock:
            out: dict[str, Healed] = {c: self._given[c] for c in chunk_ids if c in self._given}
        rest = [c for c in chunk_ids if c not in out]
        rows = repo.index.chunk_locations(rest)
        chains = {
            c: [link.chunk_id for link in to_location(rows[c], rows).chain()]
            for c in rest
            if c in rows
        }
        links = {link for ch in chains.values() for link in ch}
        if not links.isdisjoint(self._given):  # a base this read holds: written back first
            self.flush()
        if repo.write_backs.submitted(links):
            # a link an earlier read of this handle healed: read again once it landed, unless
            # damaged anew there (a whole chunk is then handed over as any other)
            from .remote.heal import damaged

            still = damaged(repo, rest)
            out.update(dict.fromkeys(set(rest) - set(still), True))
            for c in still:
                if c in chains and len(chains[c]) == 1:
                    handed = self._fetch_one(c, self._remotes, again=True)
                    if handed is not None:
                        out[c] = handed
            rest = [c for c in rest if c not in out]
        out.update(self._write_here(rest, chains))
        return out

    def flush(self) -> None:
        """Hand what this read fetched so far to the store handle's write-back thread, in one
        write-back (one new pack, one row switch per old pack), and let go of the bytes."""
        with self._queue_lock:
            fetched, self._fetched = self._fetched, []
            self._given.clear()
        if fetched:
            from .remote.heal import Fetched

            self._write_back(Fetched.joined(fetched))

    def _write_back(self, got: Fetched) -> None:
        """Write ``got`` back into this store behind the read (its failure warned at close)."""
        from .remote.heal import write_back

        repo = self.view.repo
        repo.index  # noqa: B018 - opened here, never first on the write-back thread (lowered)
        remotes = ", ".join(sorted(set(got.report.healed.values())))
        repo.write_backs.submit(
            got.raw,
            lambda: write_back(repo, got),
            f"snapshot {_label(self.view)}: {len(got.raw)} chunk(s) healed from {remotes} "
            f"({_some(sorted(got.raw))})",
        )

    def _write_here(self, chunk_ids: list[str], chains: dict[str, list[str]]) -> dict[str, Healed]:
        """Heal the damaged links of each chunk's chain, all in one heal written here before
        the fetcher reads again; whether each chunk can be read again (every damaged link of
        its chain healed, now or before)."""
        if not chunk_ids:
            return {}
        from .remote.heal import damaged, heal

        repo = self.view.repo
        # a whole chunk the fetcher found damaged is; a chain's links are read to find which
        bad = {
            c: [c] if len(ch) == 1 else damaged(repo, ch)
            for c, ch in chains.items()
            if c in chunk_ids
        }
        todo = sorted({link for links in bad.values() for link in links} - self._mended())
        if todo:
            report = heal(repo, todo, passed_over=self._passed_over)
            self.healed.update(report.healed)
            self.unreachable.update(report.unreachable)
            # neither healed nor unrecoverable: reads back sound now (a delta whose damaged
            # base was healed), or moved meanwhile; the fetcher reads and checks it again
            self._sound.update(set(todo) - set(report.healed) - set(report.unrecoverable))
        mended = self._mended()
        # a chain found sound throughout was healed by an earlier read whose write-back landed
        # since the fetcher located it: read again (the fetcher does only if its place moved)
        return {c: c in chains and all(link in mended for link in bad[c]) for c in chunk_ids}

    def _mended(self) -> set[str]:
        """The chunks this read healed, or found readable again after a heal."""
        return set(self.healed) | self._sound

    def report(self) -> None:
        """Once the read is over: :meth:`flush`, then warn :class:`HealedWarning` naming what
        this read healed, if anything."""
        self.flush()
        if self.healed:
            _warn_healed(self.view, self.healed, self.unreachable)


def with_healing(view: SnapshotView, restore: Callable[[], None]) -> None:
    """Run ``restore`` (of ``view``); when it still meets damage its fetcher could not heal,
    :func:`heal_restore` and run it again (it raises when nothing can be healed)."""
    try:
        restore()
    except (CorruptionError, ObjectNotFoundError) as exc:
        if isinstance(view.heal, RestoreHealer):  # what it healed lands first: not healed twice
            view.heal.flush()
        heal_restore(view, exc)
        restore()


def heal_restore(view: SnapshotView, error: CorruptionError | ObjectNotFoundError) -> HealReport:
    """Called when a restore of ``view`` raised ``error``: heal the snapshot's damaged chunks
    from the store's remotes and warn (:class:`HealedWarning`, naming the chunks and remotes),
    so the caller can restore again.

    Chunks healed before some stay damaged are warned about all the same: every heal is
    counted.

    Raises:
        CorruptionError, ObjectNotFoundError: ``error`` again when no chunk of the snapshot
            reads back damaged or missing (a remote that lacks an evicted pack: it may be
            back later). CorruptionError naming the snapshot, the chunks no remote could give
            back, and the run's previous healthy snapshot to restore instead, when some stay
            damaged or missing here (a deleted local pack is damage too).
    """
    from .remote.heal import damaged, heal

    repo = view.repo
    bad = damaged(repo, repo.index.snapshot_chunk_ids(view.record.id))
    if not bad:
        raise error
    if repo.read_only:
        raise CorruptionError(
            f"{error}. Snapshot {_label(view)}: {len(bad)} chunk(s) are damaged here "
            f"({_some(bad)}) and the store is open read-only: open it writable to heal them "
            f"from a remote that holds them (`ckstore repair`), or {_fallback(view)}"
        ) from error
    report = heal(repo, bad)
    if report.unrecoverable:
        if report.healed:  # healed all the same: counted, though the restore fails
            _warn_healed(view, report.healed, report.unreachable)
        down = _unreachable(report.unreachable)
        raise CorruptionError(
            f"{error}. Snapshot {_label(view)} cannot be read from any tier: "
            f"{len(report.unrecoverable)} chunk(s) are damaged here and no remote "
            f"{'that could be read ' if down else ''}holds a sound copy "
            f"({_some(report.unrecoverable)}); {down + '; ' if down else ''}{_fallback(view)}"
        ) from error
    _warn_healed(view, report.healed, report.unreachable)
    return report


def _unreachable(unreachable: dict[str, str]) -> str:
    """A sentence naming the remotes that could not be opened or read, and why ("" if none)."""
    if not unreachable:
        return ""
    why = ", ".join(f"{name!r} ({reason})" for name, reason in sorted(unreachable.items()))
    return (
        f"remote(s) that could not be opened or read: {why}; a sound copy may be there: heal "
        "again once they answer (`ckstore repair`)"
    )


def _warn_healed(
    view: SnapshotView, healed: dict[str, str], unreachable: dict[str, str] | None = None
) -> None:
    remotes = sorted(set(healed.values()))
    down = _unreachable(unreachable or {})
    warn(
        HealedWarning(
            f"snapshot {_label(view)}: {len(healed)} damaged chunk(s) healed from remote(s) "
            f"{', '.join(remotes)} ({_some(list(healed))}); the read used their verified bytes "
            "and the local copy is written back behind it (sound again by the store's close). "
            f"Run `ckstore repair` to heal the rest of the store{'. ' + down if down else ''}"
        )
    )


def _label(view: SnapshotView) -> str:
    r = view.record
    if not r.run:
        return r.id[:12]
    return f"{r.run}@{r.step} ({r.id[:12]})" if r.step is not None else f"{r.run} ({r.id[:12]})"


def _some(ids: list[str]) -> str:
    shown = ", ".join(i[:16] for i in ids[:MAX_NAMED])
    return shown + (f" and {len(ids) - MAX_NAMED} more" if len(ids) > MAX_NAMED else "")


def _fallback(view: SnapshotView) -> str:
    """A sentence offering the run's newest healthy snapshot older than ``view``'s."""
    r = view.record
    if not r.run:
        return "restore another snapshot, or re-take"
    older = [
        s
        for s in view.repo.index.list_snapshots(r.run, healthy=True)
        if s.id != r.id and s.created_at < r.created_at
    ]
    if not older:
        return f"run {r.run!r} has no earlier healthy snapshot: re-take, or restore another run"
    prev = older[0]
    return (
        f"restore the previous healthy snapshot instead: {r.run}@{prev.step} ({prev.id[:12]}); "
        f"`ckstore repair --from REMOTE` heals it once a remote holds it"
    )
