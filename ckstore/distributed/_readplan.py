"""Who reads which chunk in a distributed restore, and how the bytes travel: planned on rank 0.

Every rank numbers the chunks of the manifest the same way (:func:`table_of`: first
occurrence, keys in sorted order; the chunks a part of a manifest stored in parts names, by part
and place, alike on every rank that read the part), so what a rank needs is a short list of
index runs (a shard of a tensor is a run of its chunks; "everything" is one run). Rank 0
gathers those runs (with the sizes of the parts' chunks, which only their readers know), never
the keys or boxes behind them, and :func:`plan_reads` decides:

* **one reader per distinct chunk**: the only rank needing it, or the least-loaded by bytes of
  the ranks needing it (a heap when every rank does: O(log world));
* **transfers**, reader to each other rank needing the chunk: chunks going to at most
  ``fanout`` ranks travel by all-to-all in *rounds* where no rank sends or receives more than
  ``round_bytes`` (a chunk larger than that goes alone); chunks going to more ranks travel by
  broadcast in batches of at most ``round_bytes`` from their reader, the readers taking turns;
* **held or streamed**: held when every rank can keep what it reads for others and receives
  within its staging budget (then nothing is written anywhere before all of it has arrived).

Each rank is then sent only its part (:class:`Part`: what it sends, to whom, in which round,
and what it receives); the broadcast batches and the number of rounds are common to all. A
pure function of its inputs: every test of the assignment runs in one process.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..format.chunks import ChunkRef
from ..format.dtypes import itemsize
from ..format.manifest import Manifest, PerRankEntry, TensorEntry, canonical_json
from ..format.parts import Part as ManifestPart
from ._plan import Loads

ROUND_BYTES = 64 << 20
"""Bytes a rank sends (and receives) at most per exchange round, unless one chunk is larger."""

FANOUT = 8
"""Chunks needed by more than this many ranks besides their reader travel by broadcast."""

Runs = list[list[int]]  # [[start, stop), ...] of table indices, sorted, disjoint


@dataclass(frozen=True)
class Table:
    """The chunks a rank knows of, by their number in the job (a *slot*).

    The root's chunks (every chunk of a manifest stored whole) are numbered alike on every
    rank: ``0, 1, ...`` by first occurrence, keys in sorted order. A chunk named by part ``p``
    of a manifest stored in parts is slot ``(p + 1) << 32`` plus its place in that part, which
    every rank holding the part numbers alike; a rank knows only the parts it read.
    """

    ids: dict[int, str]
    sizes: dict[int, int]  # raw bytes
    keys: dict[int, str]  # a key holding the chunk (for messages)
    index: dict[str, int] = field(hash=False, compare=False)  # chunk id -> its first slot here
    shared: int = 0  # slots below this are the root's, the same on every rank
    checks: dict[int, str] = field(default_factory=dict, hash=False, compare=False)
    """Each chunk's check from the manifest (absent where it has none)."""

    def check(self, i: int) -> str | None:
        """The check of the chunk in slot ``i`` (None: verified by id)."""
        return self.checks.get(i)

    def digest(self) -> str:
        """A digest of the root's numbering (ids and sizes in order): equal on every rank."""
        root = [(self.ids[i], self.sizes[i]) for i in range(self.shared)]
        return blake3.blake3(canonical_json(root)).hexdigest()

    def part_sizes(self, indices: Iterable[int]) -> list[list[int]]:
        """``[slot, size]`` of the slots among ``indices`` that are parts' (rank 0 knows only
        the root's sizes)."""
        return [[i, self.sizes[i]] for i in sorted(indices) if i >= self.shared]


def table_of(manifest: Manifest, parts: Mapping[int, ManifestPart] | None = None) -> Table:
    """Number every distinct chunk of ``manifest`` (see :class:`Table`): the entries it holds
    whole by first occurrence, keys in sorted order (a manifest read from the store and the one
    a take built hold their keys in different orders); with ``parts`` (a manifest stored in
    parts), the chunks each part names, in its own order."""
    t = Table({}, {}, {}, {})
    for key in sorted(manifest.entries):
        if key not in manifest.parted:
            for entry in _tensors(manifest.entries[key]):
                size = itemsize(entry.dtype)
                for c in entry.chunks:
                    if c.id not in t.index:
                        _add(t, len(t.ids), c, math.prod(c.sizes) * size, key)
    shared = len(t.ids)
    for p, part in sorted((parts or {}).items()):
        at = (p + 1) << 32
        for key, refs in sorted(part.pieces.items()):
            shell = manifest.entries[key]
            assert isinstance(shell, TensorEntry)
            for c in refs:
                _add(t, at, c, math.prod(c.sizes) * itemsize(shell.dtype), key)
                at += 1
        for key, own in sorted(part.own.items()):
            for t_own in _tensors(own):
                for c in t_own.chunks:
                    _add(t, at, c, math.prod(c.sizes) * itemsize(t_own.dtype), key)
                    at += 1
    return Table(t.ids, t.sizes, t.keys, t.index, shared, t.checks)


def _add(t: Table, slot: int, c: ChunkRef, size: int, key: str) -> None:
    t.ids[slot], t.sizes[slot], t.keys[slot] = c.id, size, key
    if c.check is not None:
        t.checks[slot] = c.check
    t.index.setdefault(c.id, slot)


def _tensors(entry: Any) -> list[TensorEntry]:
    if isinstance(entry, TensorEntry):
        return [entry]
    if isinstance(entry, PerRankEntry):
        return list(entry.tensors())
    return []


def runs_of(indices: Iterable[int]) -> Runs:
    """Sorted disjoint ``[start, stop)`` runs covering ``indices``."""
    out: Runs = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def expand(runs: Runs) -> Iterator[int]:
    for start, stop in runs:
        yield from range(start, stop)


@dataclass
class Part:
    """One rank's share of the plan (JSON: :meth:`to_json` / :meth:`from_json`).

    ``send``: ``[round, index, [dests]]``; ``recv``: ``[round, index, src]`` (all-to-all
    rounds; broadcast batches are common to every rank, see :class:`ReadPlan`).
    """

    send: list[list[Any]] = field(default_factory=list)
    recv: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"send": self.send, "recv": self.recv}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Part:
        return cls([list(x) for x in doc["send"]], [list(x) for x in doc["recv"]])


@dataclass
class ReadPlan:
    """The whole plan, on rank 0: each rank's part and what every rank needs to know."""

    parts: list[Part]
    rounds: int
    bcast: list[list[Any]]  # [src, [indices], [sizes]] in the order they are broadcast
    held: bool
    seed: int
    read_bytes: list[int]  # per rank: bytes it reads from storage (its share)
    total: int  # distinct bytes read in all

    def common(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "bcast": self.bcast,
            "held": self.held,
            "seed": self.seed,
            "total": self.total,
            "read_bytes": _spread(self.read_bytes),
        }


def _spread(loads: list[int]) -> dict[str, float]:
    mean = sum(loads) / len(loads) if loads else 0.0
    return {"mean": mean, "max": float(max(loads, default=0)), "min": float(min(loads, default=0))}


def plan_reads(
    needs: Sequence[Runs],
    caps: Sequence[int],
    sizes: Mapping[int, int],
    *,
    atomic: bool = True,
    round_bytes: int | None = None,
    fanout: int | None = None,
    seed: int | None = None,
) -> ReadPlan:
    """Assign every needed chunk one reader and schedule its transfers (see the module docstring).

    ``needs[r]``: the runs rank ``r`` needs; ``caps[r]``: bytes rank ``r`` may keep for a held
    exchange (its staging budget); ``sizes``: raw bytes per table index; ``round_bytes`` and
    ``fanout``: default :data:`ROUND_BYTES` and :data:`FANOUT`.
    """
    round_bytes = ROUND_BYTES if round_bytes is None else round_bytes
    fanout = FANOUT if fanout is None else fanout
    world = len(needs)
    needers = _needers(needs, world)
    readers, loads = _readers(needers, sizes, world)
    parts = [Part() for _ in range(world)]
    bcast_by: list[list[int]] = [[] for _ in range(world)]
    rounds = _Rounds(world, round_bytes)
    kept = [0] * world  # held: what each rank reads for others, and what it receives
    for i, reader in sorted(readers.items()):
        dests = (
            [d for d in needers[i] if d != reader]
            if needers[i] is not ALL
            else [d for d in range(world) if d != reader]
        )
        if not dests:
            continue
        n = sizes[i]
        if needers[i] is ALL or reader in needers[i]:
            kept[reader] += n  # read into the send buffer, kept for itself too
        if len(dests) > fanout:
            bcast_by[reader].append(i)
            for d in dests:
                kept[d] += n
            continue
        k = rounds.place(reader, dests, n)
        parts[reader].send.append([k, i, dests])
        for d in dests:
            parts[d].recv.append([k, i, reader])
            kept[d] += n
    bcast = _batches(bcast_by, sizes, round_bytes)
    held = atomic and all(kept[r] <= caps[r] for r in range(world))
    return ReadPlan(
        parts,
        rounds.count,
        bcast,
        held,
        seed if seed is not None else random.getrandbits(63),
        loads,
        sum(sizes[i] for i in readers),
    )


ALL: list[int] = []  # marker: needed by every rank (shared, never mutated)


def _needers(needs: Sequence[Runs], world: int) -> dict[int, list[int]]:
    """Per table index, the ranks needing it; ranks with identical runs are expanded once."""
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r, runs in enumerate(needs):
        groups.setdefault(tuple((int(a), int(b)) for a, b in runs), []).append(r)
    out: dict[int, list[int]] = {}
    for runs_key, ranks in groups.items():
        whole = len(ranks) == world
        for i in expand([list(x) for x in runs_key]):
            if whole:
                out[i] = ALL
            else:
                out.setdefault(i, []).extend(ranks)
    return out


def _readers(
    needers: dict[int, list[int]], sizes: Mapping[int, int], world: int
) -> tuple[dict[int, int], list[int]]:
    """One reader per index: its only needer, else the least-loaded needer (lowest rank on ties)."""
    loads = Loads(world)
    readers: dict[int, int] = {}
    shared = []
    for i, ranks in needers.items():
        if ranks is not ALL and len(ranks) == 1:
            readers[i] = ranks[0]
            loads.load[ranks[0]] += sizes[i]
        else:
            shared.append(i)
    loads.reset()
    for i in sorted(shared, key=lambda x: (-sizes[x], x)):  # largest first: a tighter balance
        ranks = needers[i]
        r = loads.least(None if ranks is ALL or len(ranks) == world else sorted(set(ranks)))
        readers[i] = r
        loads.add(r, sizes[i])
    return readers, loads.load


class _Rounds:
    """All-to-all rounds: each rank sends and receives at most ``cap`` bytes per round."""

    def __init__(self, world: int, cap: int) -> None:
        self.cap = cap
        self.out: list[dict[int, int]] = []  # per round: rank -> bytes sent
        self.inn: list[dict[int, int]] = []
        self.first = [0] * world  # per rank: no room before this round (monotone)
        self.count = 0

    def place(self, src: int, dests: list[int], n: int) -> int:
        k = max([self.first[src]] + [self.first[d] for d in dests])
        while not self._fits(k, src, dests, n):
            k += 1
        while len(self.out) <= k:
            self.out.append({})
            self.inn.append({})
        self.out[k][src] = self.out[k].get(src, 0) + n * len(dests)
        for d in dests:
            self.inn[k][d] = self.inn[k].get(d, 0) + n
        for r in [src, *dests]:
            if self.out[k].get(r, 0) >= self.cap or self.inn[k].get(r, 0) >= self.cap:
                self.first[r] = max(self.first[r], k + 1)
        self.count = max(self.count, k + 1)
        return k

    def _fits(self, k: int, src: int, dests: list[int], n: int) -> bool:
        if k >= len(self.out):
            return True
        out = self.out[k].get(src, 0)
        if out and out + n * len(dests) > self.cap:
            return False
        return all(not self.inn[k].get(d, 0) or self.inn[k][d] + n <= self.cap for d in dests)


def _batches(by_reader: list[list[int]], sizes: Mapping[int, int], cap: int) -> list[list[Any]]:
    """Each reader's broadcast chunks cut into batches of at most ``cap`` bytes, the readers
    taking turns (so each reads its next batch while the others' are on the wire)."""
    cut: list[list[list[int]]] = []
    for indices in by_reader:
        batches: list[list[int]] = []
        filled = 0
        for i in indices:
            if not batches or (filled and filled + sizes[i] > cap):
                batches.append([])
                filled = 0
            batches[-1].append(i)
            filled += sizes[i]
        cut.append(batches)
    out: list[list[Any]] = []
    for turn in range(max((len(b) for b in cut), default=0)):
        for r, batches in enumerate(cut):
            if turn < len(batches):
                out.append([r, batches[turn], [sizes[i] for i in batches[turn]]])
    return out
