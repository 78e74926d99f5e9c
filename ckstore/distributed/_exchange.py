"""The byte exchange of a distributed restore: each chunk read once, sent to the ranks needing it.

Runs one rank's :class:`~ckstore.distributed._readplan.Part` of the plan: the all-to-all
rounds, then the broadcast batches (see ``_readplan``). In each, the reader reads and verifies
its chunks (the engine's :class:`~ckstore.engine.restore.fetch.Fetcher` re-hashes every one against
its id) straight into the send buffer, and appends per chunk an XXH3-64 fingerprint of the
decoded bytes (seeded per restore by rank 0). A receiver checks the size (implied by the
layout) and the fingerprint of every chunk before using it, then either keeps it
(:class:`Held`, for a held exchange: nothing is written anywhere before every rank has all
its bytes) or has the fetcher put it in place at once (streamed).

Every segment of every round starts with its sender's status word (0: fine), so all ranks
learn of a failed reader in the same round and stop together; the rank that failed raises
its error at the end, the others leave the phase normally and the phase's outcome exchange
names it. No collective is skipped or added on failure, so ranks never wait on each other
outside the bounded collectives.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ..engine.restore.fetch import Fetcher
from ..engine.restore.jobs import Job
from ..errors import CorruptionError
from ._progress import Progress
from ._readplan import Part, Table
from .comm import Comm

WORD = 8  # bytes of a status word and of a fingerprint


class Held:
    """Chunks kept for a held exchange: one buffer, a slot per chunk id (a ``ChunkSource``)."""

    def __init__(self, nbytes: int) -> None:
        self._buf = memoryview(torch.empty(max(nbytes, 1), dtype=torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        self._at = 0
        self._slots: dict[str, memoryview] = {}

    def put(self, cid: str, data: memoryview) -> None:
        n = len(data)
        if self._at + n > len(self._buf):
            raise CorruptionError(
                f"held exchange: chunk {cid[:16]}… does not fit the {len(self._buf)} bytes planned"
            )
        slot = self._buf[self._at : self._at + n]
        np.frombuffer(slot, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        self._slots[cid] = slot
        self._at += n

    def get(self, cid: str) -> memoryview | None:
        return self._slots.get(cid)


class _Source:
    """Chunks of one round by id (views into its buffers): a ``ChunkSource``."""

    def __init__(self) -> None:
        self.chunks: dict[str, memoryview] = {}

    def get(self, cid: str) -> memoryview | None:
        return self.chunks.get(cid)


class Exchange:
    """One rank's side of the exchange (see the module docstring)."""

    def __init__(
        self,
        comm: Comm,
        fetcher: Fetcher,
        table: Table,
        part: Part,
        common: dict[str, Any],
        jobs: list[Job],
        progress: Progress,
        step: str,
        held: bool,
    ) -> None:
        self.comm, self.fetcher, self.table, self.progress, self.step = (
            comm,
            fetcher,
            table,
            progress,
            step,
        )
        self.seed = int(common["seed"])
        self.rounds = int(common["rounds"])
        self.bcast: list[tuple[int, list[int]]] = [
            (int(s), [int(i) for i in ix]) for s, ix, _ in common["bcast"]
        ]
        self.sizes: dict[int, int] = dict(table.sizes)  # and of every chunk broadcast
        for _, ix, ns in common["bcast"]:
            self.sizes.update(zip((int(i) for i in ix), (int(n) for n in ns)))
        self.sends: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
        for k, i, dests in part.send:
            self.sends[int(k)].append((int(i), [int(d) for d in dests]))
        self.recvs: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for k, i, src in part.recv:
            self.recvs[int(k)].append((int(i), int(src)))
        self.jobs: dict[str, list[Job]] = defaultdict(list)
        for j in jobs:
            self.jobs[j.cid].append(j)
        self.need = {table.index[c] for c in self.jobs}
        self.error: Exception | None = None
        self.stopped = False
        self.held = Held(self.held_bytes()) if held else None

    # -- what this rank reads, sends and receives ---------------------------------------------
    def sent(self) -> set[int]:
        """Table indices this rank reads for other ranks."""
        me = self.comm.rank
        return {i for xs in self.sends.values() for i, _ in xs} | {
            i for s, ix in self.bcast if s == me for i in ix
        }

    def received(self) -> set[int]:
        """Table indices this rank needs and gets from another rank."""
        me = self.comm.rank
        return {i for xs in self.recvs.values() for i, _ in xs} | {
            i for s, ix in self.bcast if s != me for i in ix if i in self.need
        }

    def own_jobs(self) -> list[Job]:
        """Jobs of chunks this rank reads for itself alone (neither sent nor received)."""
        other = self.sent() | self.received()
        return [
            j for cid, js in self.jobs.items() if self.table.index[cid] not in other for j in js
        ]

    def sent_jobs(self) -> list[Job]:
        """One job without a destination per chunk this rank reads for others (to verify it)."""
        t = self.table
        return [Job(t.keys[i], t.ids[i], check=t.check(i)) for i in sorted(self.sent())]

    def held_bytes(self) -> int:
        return sum(self.table.sizes[i] for i in (self.received() | (self.sent() & self.need)))

    def source(self) -> Held:
        """What a held exchange kept (only after one)."""
        assert self.held is not None
        return self.held

    def jobs_of(self, indices: set[int]) -> list[Job]:
        return [j for i in sorted(indices) for j in self.jobs.get(self.table.ids[i], ())]

    # -- running it ----------------------------------------------------------------------------
    def run(self) -> None:
        """Every round and batch of the plan; raises this rank's error at the end, if any."""
        for k in range(self.rounds):
            if self.stopped:
                break
            self._round(k)
        for src, indices in self.bcast:
            if self.stopped:
                break
            self._broadcast(src, indices)
        if self.error is not None:
            raise self.error

    def _round(self, k: int) -> None:
        world, sizes = self.comm.world, self.sizes
        out: dict[int, list[int]] = defaultdict(list)
        for i, dests in self.sends.get(k, ()):
            for d in dests:
                out[d].append(i)
        inn: dict[int, list[int]] = defaultdict(list)
        for i, src in self.recvs.get(k, ()):
            inn[src].append(i)
        send_splits = [_segment(sorted(out.get(d, ())), sizes) for d in range(world)]
        recv_splits = [_segment(sorted(inn.get(s, ())), sizes) for s in range(world)]
        send = torch.empty(
            sum(send_splits), dtype=torch.uint8
        )  # every byte is written (or the status says failed)
        view = memoryview(send.numpy()).cast("B")  # type: ignore[arg-type]
        slots: dict[tuple[int, int], memoryview] = {}
        prints: dict[tuple[int, int], memoryview] = {}
        at = 0
        for d in range(world):
            _lay_out(view, at, sorted(out.get(d, ())), sizes, d, slots, prints)
            at += send_splits[d]
        if self.error is None:
            self._guard(
                lambda: self._fill([(i, ds) for i, ds in self.sends.get(k, ())], slots, prints)
            )
        status = int(self.error is not None)
        at = 0
        for d in range(world):
            view[at : at + WORD] = status.to_bytes(WORD, "little")
            at += send_splits[d]
        recv = self.comm.all_to_all(send, send_splits, recv_splits, self.step)
        rview = memoryview(recv.numpy()).cast("B")  # type: ignore[arg-type]
        at = 0
        got: list[tuple[int, int, memoryview, int]] = []
        for s in range(world):
            if int.from_bytes(rview[at : at + WORD], "little"):
                self.stopped = True  # the same on every rank: each sent its status to all
            rslots: dict[tuple[int, int], memoryview] = {}
            rprints: dict[tuple[int, int], memoryview] = {}
            _lay_out(rview, at, sorted(inn.get(s, ())), sizes, s, rslots, rprints)
            got += [
                (i, s, rslots[(s, i)], int.from_bytes(rprints[(s, i)], "little"))
                for i in sorted(inn.get(s, ()))
            ]
            at += recv_splits[s]
        self.progress.add("received", sum(len(data) for _, _, data, _ in got))
        if self.error is None and not self.stopped:
            self._guard(lambda: self._take(got))

    def _broadcast(self, src: int, indices: list[int]) -> None:
        me, sizes = self.comm.rank, self.sizes
        buf = torch.empty(_segment(indices, sizes), dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
        slots: dict[tuple[int, int], memoryview] = {}
        prints: dict[tuple[int, int], memoryview] = {}
        _lay_out(view, 0, indices, sizes, 0, slots, prints)
        if me == src:
            if self.error is None:
                self._guard(lambda: self._fill([(i, [0]) for i in indices], slots, prints))
            view[:WORD] = int(self.error is not None).to_bytes(WORD, "little")
        self.comm.broadcast_tensors([buf], self.step, src=src)
        if int.from_bytes(view[:WORD], "little"):
            self.stopped = True  # the reader failed: every rank saw it
            return
        if me != src:
            mine = [
                (i, src, slots[(0, i)], int.from_bytes(prints[(0, i)], "little"))
                for i in indices
                if i in self.need
            ]
            self.progress.add("received", sum(len(data) for _, _, data, _ in mine))
            if self.error is None:
                self._guard(lambda: self._take(mine))

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - kept, sent as this rank's status, raised at the end
            self.error = exc

    def _fill(
        self,
        sends: list[tuple[int, list[int]]],
        slots: dict[tuple[int, int], memoryview],
        prints: dict[tuple[int, int], memoryview],
    ) -> None:
        """Read and verify each chunk into its first slot; copy it to the others; fingerprint it;
        keep or put in place this rank's own need of it."""
        if not sends:
            return
        t = self.table
        self.fetcher.load(
            [Job(t.keys[i], t.ids[i], slots[(dests[0], i)], t.check(i)) for i, dests in sends]
        )
        self.progress.add("read", sum(self.table.sizes[i] for i, _ in sends))
        mine = _Source()
        for i, dests in sends:
            first = slots[(dests[0], i)]
            fp = self._print(first).to_bytes(WORD, "little")
            for d in dests:
                if d != dests[0]:
                    np.frombuffer(slots[(d, i)], dtype=np.uint8)[:] = np.frombuffer(
                        first, dtype=np.uint8
                    )
                prints[(d, i)][:] = fp
            if i in self.need:
                mine.chunks[self.table.ids[i]] = first
        self._deliver(mine)

    def _take(self, got: list[tuple[int, int, memoryview, int]]) -> None:
        """Check what arrived (size by layout, fingerprint) and keep it or put it in place."""
        mine = _Source()
        for i, src, data, fp in got:
            if len(data) != self.table.sizes[i] or self._print(data) != fp:
                raise CorruptionError(
                    f"chunk {self.table.ids[i][:16]}… of key {self.table.keys[i]!r} received from rank {src} "
                    f"does not match the fingerprint its reader sent ({len(data)} bytes); it was not used"
                )
            mine.chunks[self.table.ids[i]] = data
        self._deliver(mine)

    def _deliver(self, source: _Source) -> None:
        if not source.chunks:
            return
        if self.held is not None:
            for cid, data in source.chunks.items():
                self.held.put(cid, data)
            return
        self.fetcher.load(
            [j for cid in source.chunks for j in self.jobs.get(cid, ())], source=source
        )

    def _print(self, data: memoryview) -> int:
        return int(xxhash.xxh3_64_intdigest(data, seed=self.seed))


def _segment(indices: list[int], sizes: Mapping[int, int]) -> int:
    """Bytes of one segment: the status word, the chunks, a fingerprint per chunk."""
    return WORD + sum(sizes[i] for i in indices) + WORD * len(indices)


def _lay_out(
    view: memoryview,
    at: int,
    indices: list[int],
    sizes: Mapping[int, int],
    peer: int,
    slots: dict[tuple[int, int], memoryview],
    prints: dict[tuple[int, int], memoryview],
) -> None:
    """Name the slots of a segment starting at ``at``: chunks in index order, then fingerprints."""
    pos = at + WORD
    for i in indices:
        slots[(peer, i)] = view[pos : pos + sizes[i]]
        pos += sizes[i]
    for i in indices:
        prints[(peer, i)] = view[pos : pos + WORD]
        pos += WORD
