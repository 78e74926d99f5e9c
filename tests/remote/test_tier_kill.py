"""Issue 34's two-tier kill scenario: a store of local disk and SeaweedFS (through s3fs, on
loopback) whose training process is SIGKILLed at random points of its takes and pushes, its
local packs then damaged at random (a byte flipped, a pack truncated or deleted).

After each kill, a fresh process handle resumes (``r@healthy``, falling back to what each error
offers) and then restores every committed snapshot. The oracle is the test's own: the chunks
whose stored bytes it changed, and the chunks the remote's index holds. Every snapshot whose
damaged chunks the remote holds restores bit-exact, each healed chunk counted once in a
:class:`~ckstore.HealedWarning`; one whose damaged chunks no tier holds fails naming itself
and offering the previous healthy snapshot, never a wrong tensor; the resume never visits a
snapshot twice (no restart loop) and lands where the oracle says.

Seeded: ``CKSTORE_KILL_SEED=N`` replays one seed; a failure names its seed and round.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore import errors, objects
from ckstore.index import ChunkRecord
from ckstore.remote import uploader as uploader_mod
from tests.support.push_kills import Arm, instrument, instrument_remotes
from tests.support.remotes import KNOBS, fill, restores

pytestmark = pytest.mark.s3

SEEDS = [int(os.environ["CKSTORE_KILL_SEED"])] if "CKSTORE_KILL_SEED" in os.environ else [1, 2, 3]
ROUNDS = 3
"""Kills per seed; each round's child takes 2 or 3 more steps of run ``r``."""
MAX_EVENT = 160
"""Kill points are drawn from events 1..MAX_EVENT (a round sees about 110-180, most of them streamed pack writes): some rounds die
in a take, some in a push, some after everything was pushed."""
LOCAL_INDEX_CALLS = ("add_pack", "commit_snapshot", "mark_pushed")
HEALED = re.compile(r"snapshot (\S+@\d+) \(\w+\): (\d+) damaged chunk\(s\) healed")
OFFERED = re.compile(r"restore the previous healthy snapshot instead: (\S+@\d+) \(")


@dataclass
class Tier:
    """The SeaweedFS remote: its URL, its index file and the s3fs options."""

    url: str
    index: str
    options: dict[str, Any]

    def open_kw(self) -> dict[str, Any]:
        return {"push_to": self.url, "remote_index": self.index, "remote_options": self.options}

    def holds(self, chunk_ids: set[str]) -> set[str]:
        """The chunks of ``chunk_ids`` the remote's index places in a pack."""
        try:
            there = ckstore.open(self.url, index=self.index, storage_options=self.options)
        except errors.NotFoundError:
            return set()  # killed before its first push made it
        with there:
            found = there.repository.index.chunk_locations(sorted(chunk_ids))
            return set(found) & chunk_ids  # the rows come with their delta bases


@pytest.fixture
def tier(seaweed_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tier:
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)  # SeaweedFS refuses a session token
    bucket = "ckremote"
    if bucket not in seaweed_server.buckets():
        seaweed_server.create_bucket(bucket)
    return Tier(
        f"s3://{bucket}/{uuid.uuid4().hex[:12]}",
        f"sqlite:///{tmp_path / 'remote.sqlite'}",
        seaweed_server.remote_options(),
    )


# --- the training process ---------------------------------------------------------------------
def _training(
    local: str, open_kw: dict[str, Any], steps: list[int], kill_at: int, when: str, deltas: bool
) -> None:
    """Take ``steps`` (with ``deltas``: stored as deltas on their parents) with the uploader
    pushing, SIGKILLed at event ``kill_at`` (a local pack put or index write, a remote put or
    index write); past the last event, killed anyway."""
    uploader_mod.RETRY_SECONDS = (0.05, 0.2)
    arm = Arm(kill_at, when)
    instrument_remotes(arm)
    store = ckstore.open(local, create=True, auto_compact=False, **open_kw, **KNOBS)
    instrument(store.repository, arm, LOCAL_INDEX_CALLS)
    fill(store, "r", steps, delta_base="parent" if deltas else None)
    try:
        store.wait_pushed(timeout=30)
    except errors.CkstoreError:
        pass  # a snapshot with damaged local chunks cannot be pushed: it stays local
    os.kill(os.getpid(), signal.SIGKILL)


def _killed(
    local: Path, tier: Tier, steps: list[int], kill_at: int, when: str, deltas: bool
) -> None:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(
        target=_training, args=(str(local), tier.open_kw(), steps, kill_at, when, deltas)
    )
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"the training process hung (kill point {kill_at} {when})")
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode


# --- damage and the oracle --------------------------------------------------------------------
@dataclass
class Oracle:
    """The chunks whose local bytes the test changed and no restore has healed yet."""

    damaged: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)
    healed: int = 0
    refused: int = 0
    fallbacks: int = 0


def _pack_path(root: Path, pack_id: str) -> Path:
    return root.joinpath(*objects.pack_name(pack_id).split("/"))


def _damage(root: Path, rng: random.Random, oracle: Oracle) -> None:
    """One to three harms to local packs of committed snapshots: a byte flipped in a chunk's
    payload, a pack truncated, a pack deleted; the chunks they reach join ``oracle.damaged``."""
    with ckstore.open(root) as store:
        index = store.repository.index
        used: set[str] = set()
        for snap in store.log():
            used |= index.snapshot_chunk_ids(snap.id)
        rows = index.chunk_locations(sorted(used))
        evicted = index.remote_pack_ids()
    local = [r for r in rows.values() if r.pack_id not in evicted]
    if not local:
        return
    by_pack: dict[str, list[ChunkRecord]] = {}
    for rec in local:
        by_pack.setdefault(rec.pack_id, []).append(rec)
    for _ in range(rng.randint(1, 3)):
        harm = rng.choice(["flip", "truncate", "delete"])
        # packs by their first chunk (ids are content hashes; pack ids carry a random nonce)
        pack_id = rng.choice(sorted(by_pack, key=lambda p: min(r.chunk_id for r in by_pack[p])))
        path = _pack_path(root, pack_id)
        if not path.exists():
            continue
        os.chmod(path, 0o644)
        if harm == "flip":
            rec = rng.choice(sorted(by_pack[pack_id], key=lambda r: r.chunk_id))
            at = rec.offset + rec.length // 2
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)
                if not byte:  # truncated before
                    continue
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x10]))
            hit = {rec.chunk_id}
        elif harm == "truncate":
            cut = rng.randint(32, max(32, path.stat().st_size - 1))
            os.truncate(path, cut)
            hit = {r.chunk_id for r in by_pack[pack_id] if r.offset + r.length > cut}
        else:
            path.unlink()
            hit = {r.chunk_id for r in by_pack[pack_id]}
        oracle.damaged |= hit
        oracle.log.append(f"{harm} pack {pack_id[:12]}: {len(hit)} chunk(s)")


# --- the checks -------------------------------------------------------------------------------
@contextmanager
def _counting() -> Iterator[list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found: list[str] = []
        yield found
    found.extend(str(w.message) for w in seen if issubclass(w.category, ckstore.HealedWarning))


def _step(ref: str) -> int:
    return int(ref.rsplit("@", 1)[1])


def _attempt(store: ckstore.Store, ref: str, tier: Tier, oracle: Oracle) -> tuple[bool, str | None]:
    """Restore ``ref`` once, checked against the oracle: (restored, the ref its error offers).

    A heal rewrites a chunk whole into a new pack: the healed chunks are the rows that moved.
    They must be the damaged chunks the remote holds, and the deltas stored on one of those
    (which count as damaged while their base is), each counted once in a HealedWarning.
    """
    snap = store.get(ref)
    label = f"r@{snap.step}"
    rows = _needed(store, snap.id)
    bad = set(rows) & oracle.damaged
    held = tier.holds(bad) if bad else set()
    with _counting() as healed:
        try:
            exact = restores(store, ref, _step(label))
        except errors.CorruptionError as exc:  # a deleted pack too: damage, not a lost remote
            failed: errors.CorruptionError | None = exc
        else:
            failed = None
    store.repository.write_backs.wait()  # the heal's write-back lands behind the restore
    now = store.repository.index.chunk_locations(sorted(rows))
    moved = {c for c, r in rows.items() if c in now and now[c].pack_id != r.pack_id}
    counted = sum(int(m.group(2)) for m in map(HEALED.search, healed) if m)
    assert all(HEALED.search(h).group(1) == label for h in healed), healed  # type: ignore[union-attr]
    assert counted == len(moved), f"{label}: {len(moved)} chunk(s) healed, warnings {healed}"
    assert held <= moved, f"{label}: damaged chunks the remote holds were not healed"
    assert all(_chain(rows, c) & bad for c in moved), f"{label}: a sound chunk was healed"
    oracle.damaged -= moved
    oracle.healed += counted
    if failed is not None:
        msg = str(failed)
        assert bad - held, f"{label} failed though the remote holds every damaged chunk: {msg}"
        assert f"Snapshot {label} (" in msg, msg
        offered = OFFERED.search(msg)
        assert offered or "no earlier healthy snapshot" in msg, msg
        oracle.refused += 1
        return False, offered.group(1) if offered else None
    assert exact, f"{label} restored wrong bytes"
    assert not bad - held, f"{label} restored though chunks no tier holds were damaged"
    return True, None


def _needed(store: ckstore.Store, snapshot_id: str) -> dict[str, ChunkRecord]:
    """The rows of every chunk a restore of the snapshot reads: its own, and their delta bases."""
    index = store.repository.index
    rows: dict[str, ChunkRecord] = {}
    todo = index.snapshot_chunk_ids(snapshot_id)
    while todo:
        found = index.chunk_locations(sorted(todo))
        rows.update({c: r for c, r in found.items() if c in todo})
        todo = {r.base_id for r in found.values() if r.base_id and r.base_id not in rows}
    return rows


def _chain(rows: dict[str, ChunkRecord], cid: str) -> set[str]:
    links = {cid}
    while rows[cid].base_id is not None:
        cid = rows[cid].base_id  # type: ignore[assignment]
        links.add(cid)
    return links


def _newest_restorable(store: ckstore.Store, tier: Tier, oracle: Oracle) -> str | None:
    for snap in store.log():  # newest first
        bad = set(_needed(store, snap.id)) & oracle.damaged
        if not bad or tier.holds(bad) == bad:
            return f"r@{snap.step}"
    return None


def _resume(store: ckstore.Store, tier: Tier, oracle: Oracle) -> None:
    """``r@healthy``, then whatever each error offers: ends, never visits a snapshot twice,
    and lands on the newest snapshot whose damage the remote can heal."""
    want = _newest_restorable(store, tier, oracle)
    ref: str | None = "r@healthy"
    visited: list[str] = []
    while ref is not None:
        label = f"r@{store.get(ref).step}"
        assert label not in visited, f"restart loop: {visited + [label]}"
        visited.append(label)
        ok, ref = _attempt(store, ref, tier, oracle)
        oracle.fallbacks += ref is not None
        if ok:
            assert label == want, f"resumed from {label}, the oracle says {want} ({visited})"
            return
    assert want is None, f"the resume gave up ({visited}) though {want} restores"


def _round_checks(root: Path, tier: Tier, oracle: Oracle) -> None:
    with ckstore.open(root) as store:  # a fresh handle, as a restarted job opens it
        if not store.log():
            return
        _resume(store, tier, oracle)
        for snap in store.log()[::-1]:
            _attempt(store, f"r@{snap.step}", tier, oracle)
        for snap in store.log():  # healed: now sound without another heal
            bad = set(_needed(store, snap.id)) & oracle.damaged
            if not bad:
                with _counting() as healed:
                    assert restores(store, f"r@{snap.step}", snap.step)
                assert not healed, healed


@pytest.mark.parametrize("seed", SEEDS)
def test_two_tier_kills_and_local_damage_restore_or_name_the_fallback(
    tmp_path: Path, tier: Tier, seed: int
) -> None:
    rng = random.Random(seed)
    root = tmp_path / "local"
    oracle = Oracle()
    next_step = 1
    for rnd in range(ROUNDS):
        steps = list(range(next_step, next_step + rng.randint(2, 3)))
        kill_at, when = rng.randint(1, MAX_EVENT), rng.choice(["before", "after"])
        deltas = rng.random() < 0.5
        try:
            _killed(root, tier, steps, kill_at, when, deltas)
            if not (root / "ckstore.json").exists():
                continue  # killed before the store was made
            with ckstore.open(root) as store:
                committed = [s.step for s in store.log()]
            next_step = max(committed, default=0) + 1
            _damage(root, rng, oracle)
            _round_checks(root, tier, oracle)
        except BaseException as exc:
            exc.add_note(
                f"seed {seed} (CKSTORE_KILL_SEED={seed}), round {rnd}: steps {steps}"
                f"{' as deltas' if deltas else ''}, killed at event {kill_at} ({when}); damage "
                f"so far: {oracle.log}"
            )
            raise
    print(
        f"seed {seed}: {oracle.log}; healed {oracle.healed}, refused {oracle.refused}, "
        f"fallbacks {oracle.fallbacks}"
    )
