"""A take's guard: health figures while hashing, staleness against the run's previous snapshot,
replicas that disagree between ranks, and what the take does about them (``on_nonfinite``,
``on_stale``, ``on_divergence``).

One :class:`TakeGuard` per :class:`~ckstore.engine.take.local.LocalTake`, so every take path
(single-process, async, import, distributed, DCP) has it:

1. ``watch(dtypes)``: the take path names its tensors' dtypes (chunk key -> dtype name) once
   planned; floating-point ones get figures.
2. ``hash_chunk`` runs on the take's workers in place of a bare hash: the chunk id and check,
   and for a watched chunk its :func:`~ckstore.engine.take.statistics.chunk_stats`, from the same bytes.
   Figures are kept per (dtype, chunk id): identical bytes give identical figures, and a
   tensor's figures are the sums over its chunk refs, however its chunks were deduplicated or
   spread over ranks (``partials`` / ``merge`` carry them to the rank that commits). Chunks
   the same key's tensor held in the run's latest snapshot, recorded clean, are not measured
   again: a tensor all of whose chunks are its parent's keeps the parent's figures; one only
   partly so has exact NaN/Inf counts and no norm (``null``).
3. ``assess(entries)``, when the manifest is built: the figures per key (inline
   tensors measured there), and the keys that should have changed (``engine/take/trainable.py``)
   whose content (chunk ids, or inline bytes) equals that in the run's latest snapshot while
   the step advanced; and what a distributed take found comparing every rank's copy of its
   replicated tensors (``replicas``, set by ``distributed/take.py`` on the committing rank).
   Then the policy: warn once per key pattern, raise (nothing is committed), or stay silent;
   the findings go into the manifest header either way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import objects
from ...errors import (
    NonFiniteError,
    NonFiniteWarning,
    ReplicaDivergenceError,
    ReplicaDivergenceWarning,
    StaleStateError,
    StaleStateWarning,
    warn,
)
from ...format import health as fh
from ...format.manifest import Entry, Manifest, PerRankEntry, TensorEntry
from ...index import SnapshotRecord
from ..repository import Repository
from .packing import Chunk
from .spec import TakeSpec
from .statistics import Stats, chunk_stats, measured
from .trainable import should_change


class TakeGuard:
    """The guard of one take described by ``spec`` into ``repo`` (see the module docstring)."""

    def __init__(self, spec: TakeSpec, repo: Repository) -> None:
        self.spec = spec
        self.repo = repo
        self.opener: Callable[[SnapshotRecord], Manifest] | None = None
        """How to read the run's latest snapshot's manifest (default: whole): a rank of a
        distributed take reads only its own regions (``engine/manifests.open_partial``)."""
        self.view_key = ""
        """Which view of a manifest :func:`remember` keeps for this take ("": whole)."""
        self._dtypes: dict[str, str] = {}
        self._stats: dict[tuple[str, str], Stats] = {}
        self._as_parent: set[tuple[str, str]] = (
            set()
        )  # chunks skipped: bytes of a clean parent tensor
        # (chunk key, chunk id) of each chunk of a clean parent tensor: pairs of strings,
        # which Python's collector stops tracking (a set per key was promoted, take after take)
        self._known: set[tuple[str, str]] = set()
        self._parent: tuple[SnapshotRecord, Manifest] | None | bool = (
            False  # False: not looked up yet
        )
        self.replicas: fh.Replicas | None = None
        """What comparing the ranks' copies of replicated tensors found (None: not compared)."""

    # --- while hashing ----------------------------------------------------------------------
    def watch(self, dtypes: Mapping[str, str], manifest_key: Callable[[str], str] = str) -> None:
        """Measure the chunks of these keys (chunk key -> dtype name) from now on.

        A chunk whose bytes belong to the same key's tensor in the run's latest snapshot,
        where that tensor was recorded free of NaN and Inf, is not measured again: it holds
        none either (a frozen layer costs nothing). ``manifest_key`` maps a chunk key to its
        manifest key (a DCP save's chunks are keyed by FQN).
        """
        if not self.spec.health:
            return
        self._dtypes.update({k: d for k, d in dtypes.items() if measured(d)})
        parent = self.parent()
        health = fh.of_header(parent[1].snapshot) if parent is not None else None
        if parent is None or health is None or health.tensors is None:
            return
        for key, dtype in self._dtypes.items():
            mk = manifest_key(key)
            before, figures = parent[1].entries.get(mk), health.tensors.get(mk)
            if (
                isinstance(before, TensorEntry)
                and before.dtype == dtype
                and before.data is None
                and figures is not None
                and figures.nan == figures.inf == 0
            ):
                self._known.update((key, ref.id) for ref in before.chunks)

    def hash_chunk(self, chunk: Chunk) -> tuple[str, str, Stats | None | bool]:
        """The chunk's id, its check (``objects.raw_check``, from the same bytes) and, if
        watched, its figures, or True when a clean parent tensor held the same bytes (on a
        worker thread)."""
        view = chunk.ready()
        cid = objects.chunk_id(view)
        check = objects.raw_check(view, cid)
        dtype = self._dtypes.get(chunk.key)
        if dtype is None:
            return cid, check, None
        if (chunk.key, cid) in self._known:
            return cid, check, True
        return cid, check, chunk_stats(view, dtype)

    def record(self, chunk: Chunk, stats: Stats | None | bool) -> None:
        """Keep a hashed chunk's figures (on the thread that hashes)."""
        if stats is True:
            self._as_parent.add((self._dtypes[chunk.key], chunk.id))
        elif isinstance(stats, tuple):
            self._stats[(self._dtypes[chunk.key], chunk.id)] = stats

    def partials(self) -> list[list[Any]]:
        """This process's figures, JSON-able, for the process that commits."""
        return [[d, cid, *s] for (d, cid), s in self._stats.items()] + [
            [d, cid] for d, cid in self._as_parent
        ]

    def merge(self, partials: Iterable[list[Any]]) -> None:
        """Add another process's :meth:`partials`."""
        for d, cid, *figures in partials:
            if figures:
                nan, inf, sumsq = figures
                self._stats[(str(d), str(cid))] = (int(nan), int(inf), float(sumsq))
            else:
                self._as_parent.add((str(d), str(cid)))

    def parent(self) -> tuple[SnapshotRecord, Manifest] | None:
        """The run's latest snapshot when first asked (the take's start), and its manifest
        (from :func:`remember` when this process committed it: a training loop's previous
        take is never read back)."""
        if self._parent is False:
            latest = self.repo.index.list_snapshots(run=self.spec.run, limit=1)
            if latest:
                opener = self.opener or self.repo.load_manifest
                manifest = _RECENT.get(latest[0].manifest_id + self.view_key) or opener(latest[0])
                self._parent = (latest[0], manifest)
            else:
                self._parent = None
        assert self._parent is not True
        return self._parent

    # --- a take in parts: each rank's share of the figures, summed over the ranks ------------
    def local_figures(
        self, dtype: str, refs: Iterable[str] = (), data: bytes | None = None
    ) -> tuple[list[int], float]:
        """This process's share of one tensor's figures: over the chunks it hashed (``refs``)
        or its inline bytes ``data``, as ``[nan, inf, chunks, as_parent, unmeasured, shares,
        inline]`` and the sum of squares, to be summed over the ranks (:meth:`summed`)."""
        if not self.spec.health or not measured(dtype):
            return [0] * FIGURES, 0.0
        if data is not None:
            nan, inf, sumsq = chunk_stats(memoryview(bytearray(data)), dtype)
            return [nan, inf, 0, 0, 0, 1, 1], sumsq
        out, sumsq = [0, 0, 0, 0, 0, 1, 0], 0.0
        for cid in refs:
            out[2] += 1
            s = self._stats.get((dtype, cid))
            if s is not None:
                out[0], out[1], sumsq = out[0] + s[0], out[1] + s[1], sumsq + s[2]
            elif (dtype, cid) in self._as_parent:
                out[3] += 1
            else:
                out[4] += 1
        return out, sumsq

    def summed(
        self, key: str, figures: list[int], sumsq: float, same: bool
    ) -> fh.TensorHealth | None:
        """One tensor's figures from every rank's :meth:`local_figures`, summed; ``same``: its
        content is the run's latest snapshot's (all ranks agreed). None: not measured."""
        nan, inf, chunks, as_parent, unmeasured, shares, inline = figures
        if not shares or unmeasured:
            return None
        if chunks and as_parent == chunks and not inline and same:
            parent = self.parent()
            before = fh.of_header(parent[1].snapshot) if parent is not None else None
            kept = (before.tensors or {}).get(key) if before is not None else None
            return kept if kept is not None else fh.TensorHealth(0, 0, None)
        norm = None if as_parent else sumsq**0.5
        return fh.TensorHealth(nan, inf, norm if norm is not None and norm < float("inf") else None)

    def differs(self, key: str, entry: Entry, rank: int | None = None, world: int = 1) -> bool:
        """Whether ``entry`` (this rank's part of ``key``: its pieces, or its own value of a
        per-rank entry, ``rank`` of ``world``) is not the same content as in the run's latest
        snapshot, as far as this rank sees it."""
        parent = self.parent()
        before = parent[1].entries.get(key) if parent is not None else None
        if before is None or parent is None:
            return True
        if rank is not None:  # a per-rank value: the parent's value for this rank
            if (parent[1].snapshot or {}).get("world_size", 1) != world:
                return True
            if isinstance(before, PerRankEntry):
                before = before.entries[rank] if rank < before.world_size else None
            return not _same(entry, before)
        if not isinstance(entry, TensorEntry) or not isinstance(before, TensorEntry):
            return True
        if (entry.dtype, entry.shape, entry.container) != (
            before.dtype,
            before.shape,
            before.container,
        ) or before.data is not None:
            return True
        return not set(entry.chunks) <= set(before.chunks)

    # --- when the manifest is built ---------------------------------------------------------
    def assess(self, entries: Mapping[str, Any], summed: Summed | None = None) -> fh.Health:
        """The take's findings, after applying the policies. ``summed``: the figures and the
        unchanged keys every rank of a take in parts contributed to (``entries`` then only
        names the keys).

        Raises:
            NonFiniteError: ``on_nonfinite="raise"`` and a tensor holds NaN or Inf.
            StaleStateError: ``on_stale="raise"`` and a tensor that should train is stale.
            ReplicaDivergenceError: ``on_divergence="raise"`` and replicas disagree.
        """
        if summed is None:
            tensors = self._figures(entries) if self.spec.health else None
            stale, base = self._stale(entries)
        else:
            tensors = dict(summed.tensors) if self.spec.health else None
            stale, base = self._stale(entries, summed.same.__contains__)
        found = fh.Health(tensors, stale, base, self.replicas)
        self._apply(found)
        return found

    def _figures(self, entries: Mapping[str, Entry]) -> dict[str, fh.TensorHealth]:
        parent = self.parent()
        before = fh.of_header(parent[1].snapshot) if parent is not None else None
        out = {}
        for key, entry in entries.items():
            parts = entry.entries if isinstance(entry, PerRankEntry) else (entry,)
            sums = [
                self._entry_stats(e)
                for e in parts
                if isinstance(e, TensorEntry) and measured(e.dtype)
            ]
            if not sums or any(s is None for s in sums):
                continue
            if (
                all(s == _AS_PARENT for s in sums)
                and parent is not None
                and _same(entry, parent[1].entries.get(key))
            ):
                kept = (before.tensors or {}).get(key) if before is not None else None
                if kept is not None and is_sentinel_key(key):
                    kept = fh.TensorHealth(kept.nan, 0, kept.norm)
                out[key] = kept if kept is not None else fh.TensorHealth(0, 0, None)
                continue
            known = [s for s in sums if s is not None]
            sumsq = (
                None if any(s[2] is None for s in known) else sum(float(s[2] or 0.0) for s in known)
            )
            norm = None if sumsq is None else sumsq**0.5
            out[key] = fh.TensorHealth(
                sum(s[0] for s in known),
                0 if is_sentinel_key(key) else sum(s[1] for s in known),
                norm if norm is not None and norm < float("inf") else None,
            )
        return out

    def _entry_stats(self, e: TensorEntry) -> tuple[int, int, float | None] | None:
        """NaN, Inf and sum of squares over the entry's chunks (sum None: some chunks are a clean
        parent's, whose norm is not kept per chunk); None when a chunk was never measured."""
        if e.data is not None:
            return chunk_stats(memoryview(bytearray(e.data)), e.dtype)
        nan = inf = 0
        sumsq: float | None = 0.0
        skipped = 0
        for ref in e.chunks:
            s = self._stats.get((e.dtype, ref.id))
            if s is not None:
                nan, inf = nan + s[0], inf + s[1]
                sumsq = None if sumsq is None else sumsq + s[2]
            elif (e.dtype, ref.id) in self._as_parent:
                skipped += 1
                sumsq = None
            else:
                return None  # a chunk this process never saw the figures of
        return _AS_PARENT if e.chunks and skipped == len(e.chunks) else (nan, inf, sumsq)

    def _stale(
        self, entries: Mapping[str, Any], same: Callable[[str], bool] | None = None
    ) -> tuple[tuple[str, ...] | None, dict[str, Any] | None]:
        spec = self.spec
        parent = self.parent() if spec.step is not None else None
        if (
            parent is None
            or parent[0].step is None
            or spec.step is None
            or parent[0].step >= spec.step
        ):
            return None, None
        record, manifest = parent
        base = {"id": record.id, "step": record.step}
        watched = should_change(entries, spec.trainable_keys, spec.trainable)
        before = manifest.entries
        if same is None:
            return tuple(
                sorted(k for k in watched if k in before and _same(entries[k], before[k]))
            ), base
        return tuple(sorted(k for k in watched if k in before and same(k))), base

    def _apply(self, found: fh.Health) -> None:
        spec = self.spec
        where = (
            f"take of {spec.run}@{spec.step}"
            if spec.step is not None
            else f"take of run {spec.run!r}"
        )
        bad = found.bad_keys
        if bad and spec.on_nonfinite == "raise":
            raise NonFiniteError(
                f"{where}: NaN or Inf in {len(bad)} tensor(s): {fh.describe(bad)}; nothing was "
                "committed (on_nonfinite='raise')",
                keys=bad,
            )
        stale = list(found.stale or ())
        if stale and spec.on_stale == "raise":
            raise StaleStateError(
                f"{where}: {len(stale)} tensor(s) that should train did not change since step "
                f"{(found.stale_base or {}).get('step')}: {fh.describe(stale)}; nothing was committed "
                "(on_stale='raise'). Is the optimizer stepping, and is this the state it trains?",
                keys=stale,
            )
        diverged = found.diverged
        apart = sorted({r for d in diverged.values() for r in d.ranks})
        if diverged and spec.on_divergence == "raise":
            raise ReplicaDivergenceError(
                f"{where}: {len(diverged)} replicated tensor(s) differ between ranks "
                f"(rank(s) {apart} hold other bytes than the others): {_where(diverged)}; "
                "nothing was committed (on_divergence='raise'). Roll back to the last snapshot "
                f"whose replicas agreed (store.get('{spec.run}@healthy')) and check those ranks' "
                "hosts",
                keys=diverged,
                ranks=apart,
            )
        if bad and spec.on_nonfinite == "warn":
            for pattern, keys in fh.by_pattern(bad).items():
                warn(
                    NonFiniteWarning(
                        f"ckstore: {where}: NaN/Inf in {_name(keys, pattern)}; "
                        "committed, recorded unhealthy "
                        f"(roll back with store.get('{spec.run}@healthy'))"
                    )
                )
        if stale and spec.on_stale == "warn":
            step = (found.stale_base or {}).get("step")
            for pattern, keys in fh.by_pattern(stale).items():
                warn(
                    StaleStateWarning(
                        f"ckstore: {where}: {_name(keys, pattern)} did not change "
                        f"since step {step} although it should train"
                    )
                )
        if diverged and spec.on_divergence == "warn":
            for pattern, keys in fh.by_pattern(diverged).items():
                warn(
                    ReplicaDivergenceWarning(
                        f"ckstore: {where}: replicas of {_name(keys, pattern)} differ between "
                        f"ranks: {_where({k: diverged[k] for k in keys})}; committed, recorded "
                        f"unhealthy (roll back with store.get('{spec.run}@healthy'))"
                    )
                )


def _where(diverged: Mapping[str, fh.Divergence], limit: int = 4) -> str:
    """Which ranks and regions of which keys differ, briefly."""
    parts = []
    for key, d in list(diverged.items())[:limit]:
        ranks = f"rank {', '.join(map(str, d.ranks))}" if d.ranks else "ranks not located"
        first = f", first at offsets {list(d.regions[0][0])}" if d.regions else ""
        parts.append(f"{key} ({ranks}; {d.region_count} region(s){first})")
    more = f" and {len(diverged) - limit} more" if len(diverged) > limit else ""
    return "; ".join(parts) + more


SENTINEL_APPS = ("callbacks",)
"""Apps whose tensors may hold ±Inf on purpose: a trainer's callback state, where Lightning's
``ModelCheckpoint`` keeps ``kth_value = inf`` until it holds ``save_top_k`` checkpoints (for
ever with ``monitor=None``) and ``EarlyStopping`` starts ``best_score`` at ±inf. Their Inf is
"no score yet", not a diverged value, so it is not counted; a NaN there still is."""


def is_sentinel_key(key: str) -> bool:
    """Whether ``key`` lies in one of :data:`SENTINEL_APPS` (its Inf is not counted)."""
    return key.split("/", 1)[0] in SENTINEL_APPS


def _name(keys: list[str], pattern: str) -> str:
    """A key pattern's keys: the key itself when alone, else the pattern and how many."""
    return keys[0] if len(keys) == 1 else f"{pattern} ({len(keys)} tensors)"


_RECENT: OrderedDict[str, Manifest] = OrderedDict()
"""Manifests this process committed last, by id (ids are content hashes: valid in any store)."""
_RECENT_SIZE = 4
_RECENT_LOCK = threading.Lock()


def remember(manifest_id: str, manifest: Manifest, view_key: str = "") -> None:
    """Keep a manifest this process just committed: the next take of its run compares with it
    (``view_key``: a rank's view of it, :attr:`TakeGuard.view_key`)."""
    manifest_id += view_key
    with _RECENT_LOCK:
        _RECENT[manifest_id] = manifest
        _RECENT.move_to_end(manifest_id)
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.popitem(last=False)


FIGURES = 7
"""Ints in :meth:`TakeGuard.local_figures`' share of a tensor's figures."""


@dataclass(frozen=True)
class Summed:
    """What the ranks of a take in parts found together: figures per tensor, and the keys
    whose content is the run's latest snapshot's."""

    tensors: Mapping[str, fh.TensorHealth]
    same: frozenset[str]


_AS_PARENT = (0, 0, None)
"""The figures of an entry every chunk of which a clean parent tensor held."""


def _same(a: Entry, b: Entry | None) -> bool:
    """Whether two entries hold the same tensor content (same chunk ids, or inline bytes)."""
    if isinstance(a, PerRankEntry) and isinstance(b, PerRankEntry):
        return len(a.entries) == len(b.entries) and all(
            _same(x, y) for x, y in zip(a.entries, b.entries)
        )
    if not isinstance(a, TensorEntry) or not isinstance(b, TensorEntry):
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.container != b.container:
        return False
    return a.data == b.data if a.data is not None or b.data is not None else a.chunks == b.chunks
