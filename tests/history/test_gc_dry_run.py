"""Retention that knows tiers, exactly (issue 34, item 6): on random histories with pending
pushes, ``gc --dry-run`` predicts the real gc figure for figure, ``bytes_reclaimed`` is what
the packs the real gc deleted took in the store, and no snapshot the persistent tier does not
hold yet is dropped.

Each history is seeded: runs of snapshots whose tensors change in part from step to step,
tags, an earlier gc or a compaction now and then (retired and dense packs, some kept by a
grace period that has run out since), a pack nobody recorded (an orphan), and a tier remote
that holds only some of the snapshots.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

import ckstore

KNOBS = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
GRACE = 1.5
"""The grace period of the gcs that keep some data: the history waits it out, then takes one
more step of each run, well inside it (so no row is near the cutoff of either gc)."""
FIGURES = (
    "snapshots_dropped",
    "snapshots_kept",
    "snapshots_kept_unpushed",
    "chunks_removed",
    "chunk_bytes_removed",
    "packs_retired",
    "packs_rewritten",
    "packs_removed",
    "manifests_removed",
    "orphans_removed",
    "uploads_aborted",
    "bytes_reclaimed",
)


def _history(store: ckstore.Store, rng: random.Random, first: int = 1, steps: int = 0) -> None:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    runs = ["a", "b"][: rng.randint(1, 2)]
    states = {r: {f"t{i}": torch.randn(24, 32, generator=gen) for i in range(3)} for r in runs}
    for step in range(first, first + (steps or rng.randint(3, 7))):
        for run in runs:
            state = states[run]
            for name in rng.sample(sorted(state), rng.randint(1, 3)):
                rows = rng.randrange(24)
                state[name][rows : rows + rng.randint(1, 8)] = torch.randn(1, 32, generator=gen)
            snap = store.take({"m": ckstore.StateDict(state)}, run=run, step=step)
            if rng.random() < 0.15:
                store.tag(snap.id, f"keep-{run}-{step}")
        if rng.random() < 0.2:
            store.gc(keep_last=rng.randint(1, 3), grace_seconds=0)
        if rng.random() < 0.2:
            store.compact(keep_loose=rng.randint(0, 1))


def _orphan(store: ckstore.Store, rng: random.Random) -> None:
    """A pack in the store the index never recorded (a take killed before its commit)."""
    raw = rng.randbytes(3000)
    writer = store.repository.objects.new_pack_writer()
    writer.add(ckstore.objects.chunk_id(raw), "none", raw, len(raw))
    assert writer.finish() is not None


def _pending_pushes(store: ckstore.Store, tmp: Path, rng: random.Random) -> set[str]:
    """A tier remote holding a random part of the snapshots, one of which it may have lost
    since (deleted there: its index restored from an older backup); returns the ids that are
    only here."""
    index = store.repository.index
    store.add_remote("tier", tmp / "remote")
    index.set_remote_tier("tier", True)
    pushed = [s.id for s in store.log() if rng.random() < 0.6]
    if pushed:
        store.push("tier", pushed)
    if not pushed:
        return index.unpushed_to_tiers()
    with ckstore.open(tmp / "remote") as remote:
        if rng.random() < 0.5:
            remote.delete(rng.choice(pushed), force=True)
        lost = index.held_by("tier") - {s.id for s in remote.log()}
    return index.unpushed_to_tiers() | lost


def _packs(store: ckstore.Store) -> dict[str, int]:
    objs = store.repository.objects
    return {p: objs.pack_size(p) for p in objs.list_packs()}


@pytest.mark.parametrize("seed", range(20))
def test_dry_run_predicts_the_gc_exactly_and_keeps_what_only_this_store_has(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        _history(store, rng)
        if rng.random() < 0.5:
            _orphan(store, rng)
        pending = _pending_pushes(store, tmp_path, rng) if rng.random() < 0.8 else set()
        grace = rng.choice([0.0, GRACE])
        if grace:  # the history is past the grace period, its last step is not
            if rng.random() < 0.7:  # packs retired by a gc, then kept past a short grace
                time.sleep(0.3)
                store.gc(keep_last=1, grace_seconds=0.25)
            time.sleep(GRACE + 0.1)
            _history(store, rng, first=100, steps=1)
        options = {
            "keep_last": rng.randint(0, 2),
            "keep_every_steps": rng.choice([None, 2, 3]),
            "keep_tagged": rng.random() < 0.7,
            "keep_healthy": rng.random() < 0.5,
            "repack_below": rng.choice([0.0, 0.5, 0.9]),
            "grace_seconds": grace,
        }
        packs = _packs(store)
        log = {s.id for s in store.log()}
        dry = store.gc(dry_run=True, **options)
        assert _packs(store) == packs and {s.id for s in store.log()} == log  # nothing changed
        real = store.gc(**options)
        for name in FIGURES:
            assert getattr(dry, name) == getattr(real, name), (name, options)
        freed = {p: n for p, n in packs.items() if p not in _packs(store)}
        assert real.bytes_reclaimed == sum(freed.values())  # the bytes the store no longer holds
        assert len(freed) >= real.packs_removed  # and the orphans among orphans_removed
        kept = {s.id for s in store.log()}
        assert pending & log <= kept  # never the only durable copy
        assert store.check(read_data=True).ok


def test_a_dry_run_counts_the_pins_of_sessions_the_gc_would_expire_as_gone(
    tmp_path: Path,
) -> None:
    """A take killed mid-way leaves a session whose pins hold its chunks until its lease ends;
    the gc expires it first, and so does the dry run's prediction."""
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        state = {"w": torch.randn(64, 64)}
        store.take({"m": ckstore.StateDict(state)}, run="r", step=1)
        index = store.repository.index
        lapsed = index.begin_session("someone-else", 0.5)
        chunk_ids = [c.chunk_id for c in index.all_chunks()]
        assert len(index.lookup_chunks(lapsed.id, chunk_ids)) == len(chunk_ids)  # pinned
        store.delete("r@1")
        held = store.gc(dry_run=True, grace_seconds=0)
        assert held.chunks_removed == 0 and held.bytes_reclaimed == 0  # its lease runs
        time.sleep(0.6)
        dry = store.gc(dry_run=True, grace_seconds=0)
        real = store.gc(grace_seconds=0)
        assert real.chunks_removed == dry.chunks_removed == len(chunk_ids)
        assert real.bytes_reclaimed == dry.bytes_reclaimed > 0
