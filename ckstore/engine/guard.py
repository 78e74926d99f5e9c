"""A take's guard: health figures while hashing, staleness against the run's previous snapshot,
and what the take does about them (``on_nonfinite``, ``on_stale``).

One :class:`TakeGuard` per :class:`~ckstore.engine.local_take.LocalTake`, so every take path
(single-process, async, import, distributed, DCP) has it:

1. ``watch(dtypes)``: the take path names its tensors' dtypes (chunk key -> dtype name) once
   planned; floating-point ones get figures.
2. ``hash_chunk`` runs on the take's workers in place of a bare hash: the chunk id, and for a
   watched chunk its :func:`~ckstore.engine.tensor_stats.chunk_stats`, from the same bytes.
   Figures are kept per (dtype, chunk id): identical bytes give identical figures, and a
   tensor's figures are the sums over its chunk refs, however its chunks were deduplicated or
   spread over ranks (``partials`` / ``merge`` carry them to the rank that commits).
3. ``assess(repo, entries)``, when the manifest is built: the figures per key (inline
   tensors measured there), and the keys that should have changed (``engine/trainable.py``)
   whose content (chunk ids, or inline bytes) equals that in the run's latest snapshot while
   the step advanced. Then the policy: warn once per key pattern, raise (nothing is
   committed), or stay silent; the findings go into the manifest header either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .. import objects
from ..errors import NonFiniteError, NonFiniteWarning, StaleStateError, StaleStateWarning
from ..format import health as fh
from ..format.manifest import Entry, PerRankEntry, TensorEntry
from .packing import Chunk
from .repository import Repository
from .spec import TakeSpec
from .tensor_stats import Stats, chunk_stats, measured
from .trainable import should_change


class TakeGuard:
    """The guard of one take described by ``spec`` (see the module docstring)."""

    def __init__(self, spec: TakeSpec) -> None:
        self.spec = spec
        self._dtypes: dict[str, str] = {}
        self._stats: dict[tuple[str, str], Stats] = {}

    # --- while hashing ----------------------------------------------------------------------
    def watch(self, dtypes: Mapping[str, str]) -> None:
        """Measure the chunks of these keys (chunk key -> dtype name) from now on."""
        if self.spec.health:
            self._dtypes.update({k: d for k, d in dtypes.items() if measured(d)})

    def hash_chunk(self, chunk: Chunk) -> tuple[str, Stats | None]:
        """The chunk's id and, if watched, its figures (on a worker thread)."""
        view = chunk.ready()
        dtype = self._dtypes.get(chunk.key)
        return objects.chunk_id(view), None if dtype is None else chunk_stats(view, dtype)

    def record(self, chunk: Chunk, stats: Stats | None) -> None:
        """Keep a hashed chunk's figures (on the thread that hashes)."""
        if stats is not None:
            self._stats[(self._dtypes[chunk.key], chunk.id)] = stats

    def partials(self) -> list[list[Any]]:
        """This process's figures, JSON-able, for the process that commits."""
        return [[d, cid, *s] for (d, cid), s in self._stats.items()]

    def merge(self, partials: Iterable[list[Any]]) -> None:
        """Add another process's :meth:`partials`."""
        for d, cid, nan, inf, sumsq in partials:
            self._stats[(str(d), str(cid))] = (int(nan), int(inf), float(sumsq))

    # --- when the manifest is built ---------------------------------------------------------
    def assess(self, repo: Repository, entries: Mapping[str, Entry]) -> fh.Health:
        """The take's findings, after applying the policies.

        Raises:
            NonFiniteError: ``on_nonfinite="raise"`` and a tensor holds NaN or Inf.
            StaleStateError: ``on_stale="raise"`` and a tensor that should train is stale.
        """
        tensors = self._figures(entries) if self.spec.health else None
        stale, base = self._stale(repo, entries)
        found = fh.Health(tensors, stale, base)
        self._apply(found)
        return found

    def _figures(self, entries: Mapping[str, Entry]) -> dict[str, fh.TensorHealth]:
        out = {}
        for key, entry in entries.items():
            parts = entry.entries if isinstance(entry, PerRankEntry) else (entry,)
            sums = [self._entry_stats(e) for e in parts if isinstance(e, TensorEntry) and measured(e.dtype)]
            if sums and all(s is not None for s in sums):
                nan, inf, sumsq = (sum(x) for x in zip(*(s for s in sums if s is not None)))
                norm = sumsq ** 0.5
                out[key] = fh.TensorHealth(int(nan), int(inf), norm if norm < float("inf") else None)
        return out

    def _entry_stats(self, e: TensorEntry) -> Stats | None:
        if e.data is not None:
            return chunk_stats(memoryview(bytearray(e.data)), e.dtype)
        total = [0, 0, 0.0]
        for ref in e.chunks:
            s = self._stats.get((e.dtype, ref.id))
            if s is None:
                return None  # a chunk this process never saw the figures of
            total[0] += s[0]
            total[1] += s[1]
            total[2] += s[2]
        return int(total[0]), int(total[1]), float(total[2])

    def _stale(self, repo: Repository, entries: Mapping[str, Entry]) -> tuple[tuple[str, ...] | None, dict[str, Any] | None]:
        spec = self.spec
        if spec.step is None:
            return None, None
        latest = repo.index.list_snapshots(run=spec.run, limit=1)
        if not latest or latest[0].step is None or latest[0].step >= spec.step:
            return None, None
        parent = latest[0]
        base = {"id": parent.id, "step": parent.step}
        watched = should_change(entries, spec.trainable_keys, spec.trainable)
        if not watched:
            return (), base
        before = repo.load_manifest(parent).entries
        return tuple(sorted(k for k in watched if k in before and _same(entries[k], before[k]))), base

    def _apply(self, found: fh.Health) -> None:
        spec = self.spec
        where = f"take of {spec.run}@{spec.step}" if spec.step is not None else f"take of run {spec.run!r}"
        bad = found.bad_keys
        if bad and spec.on_nonfinite == "raise":
            raise NonFiniteError(f"{where}: NaN or Inf in {len(bad)} tensor(s): {fh.describe(bad)}; nothing was "
                                 "committed (on_nonfinite='raise')", keys=bad)
        stale = list(found.stale or ())
        if stale and spec.on_stale == "raise":
            raise StaleStateError(
                f"{where}: {len(stale)} tensor(s) that should train did not change since step "
                f"{(found.stale_base or {}).get('step')}: {fh.describe(stale)}; nothing was committed "
                "(on_stale='raise'). Is the optimizer stepping, and is this the state it trains?", keys=stale)
        if bad and spec.on_nonfinite == "warn":
            for pattern, keys in fh.by_pattern(bad).items():
                warnings.warn(NonFiniteWarning(f"ckstore: {where}: NaN/Inf in {_name(keys, pattern)}; "
                                               "committed, recorded unhealthy "
                                               f"(roll back with store.get('{spec.run}@healthy'))"), stacklevel=2)
        if stale and spec.on_stale == "warn":
            step = (found.stale_base or {}).get("step")
            for pattern, keys in fh.by_pattern(stale).items():
                warnings.warn(StaleStateWarning(f"ckstore: {where}: {_name(keys, pattern)} did not change "
                                                f"since step {step} although it should train"), stacklevel=2)


def _name(keys: list[str], pattern: str) -> str:
    """A key pattern's keys: the key itself when alone, else the pattern and how many."""
    return keys[0] if len(keys) == 1 else f"{pattern} ({len(keys)} tensors)"


def _same(a: Entry, b: Entry) -> bool:
    """Whether two entries hold the same tensor content (same chunk ids, or inline bytes)."""
    if isinstance(a, PerRankEntry) and isinstance(b, PerRankEntry):
        return len(a.entries) == len(b.entries) and all(_same(x, y) for x, y in zip(a.entries, b.entries))
    if not isinstance(a, TensorEntry) or not isinstance(b, TensorEntry):
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.container != b.container:
        return False
    return a.data == b.data if a.data is not None or b.data is not None else a.chunks == b.chunks
