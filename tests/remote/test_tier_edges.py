"""The local tier's eviction at its edges: a remote that stores a delta pair the other way
round, and a remote removed by another process while an eviction pass proves its packs.

Each lost committed snapshots before its fix (the first also hung the uploader forever inside a
write transaction with ``local_budget=0``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import NotFoundError
from tests.support.remotes import KNOBS, fill, restores

OPTS = dict(KNOBS, auto_compact=False)


def _x_and_z() -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk each (1 KiB), a few elements apart: either is a small XOR delta of the other."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(7))
    z = x.clone()
    z[::17] += 1e-3
    return x, z


def _take(store: ckstore.Store, run: str, step: int, t: torch.Tensor, **kw: Any) -> None:
    store.take({"m": ckstore.StateDict({"w": t.clone()})}, run=run, step=step, **kw)


def _holds(store: ckstore.Store, ref: str, t: torch.Tensor) -> bool:
    out = {"m": ckstore.StateDict({"w": torch.zeros_like(t)})}
    store.get(ref).restore(out)
    return torch.equal(out["m"]["w"], t)


def _opposite_pairs(tmp_path: Path) -> tuple[Path, int, torch.Tensor, torch.Tensor]:
    """A remote where x is a delta against z (another producer wrote it), and a local store where
    z is a delta against x, with that remote as ``tier``; the local store and its bytes."""
    x, z = _x_and_z()
    remote = tmp_path / "remote"
    with ckstore.open(remote, create=True, **OPTS) as there:
        _take(there, "b", 1, z)
        _take(there, "b", 2, x, delta_base="parent")
        assert [c.base_id is None for c in there.repository.index.all_chunks()].count(True) == 1
    local = tmp_path / "local"
    with ckstore.open(local, create=True, **OPTS) as here:
        here.add_remote("tier", str(remote))
        _take(here, "r", 1, x)
        _take(here, "r", 2, z, delta_base="parent")
        total = sum(size for _, size, _ in here.repository.index.local_packs_by_use())
    return local, total, x, z


@pytest.mark.parametrize("spare", [1, "all"], ids=["one-byte-over", "budget-zero"])
def test_eviction_onto_a_remote_whose_delta_runs_the_other_way_keeps_both_readable(
    tmp_path: Path, spare: int | str
) -> None:
    local, total, x, z = _opposite_pairs(tmp_path)
    budget = 0 if spare == "all" else total - 1
    with ckstore.open(local, push_to="tier", local_budget=budget, **OPTS) as store:
        assert store.wait_pushed(timeout=60), "the uploader never finished its eviction pass"
        assert store.last_eviction is not None and store.last_eviction.local_bytes_after <= budget
        assert _holds(store, "r@1", x) and _holds(store, "r@2", z)
    with ckstore.open(local) as plain:
        rows = {c.chunk_id: c for c in plain.repository.index.all_chunks()}
        for row in rows.values():  # every chain ends at a whole chunk: no cycle was recorded
            seen, at = set(), row
            while at.base_id is not None:
                assert at.chunk_id not in seen
                seen.add(at.chunk_id)
                at = rows[at.base_id]
        assert _holds(plain, "r@1", x) and _holds(plain, "r@2", z)
        assert plain.check(read_data=True).ok


def test_a_remote_removed_during_an_eviction_pass_gets_nothing_evicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process runs ``ckstore remote rm tier`` while the pass proves packs at the remote
    (a stat and sample reads per pack: network round trips). Nothing evicted yet, so the removal
    is allowed; the pass must then switch nothing and delete no local pack."""
    from ckstore.remote import evict as evict_module

    local = tmp_path / "local"
    with ckstore.open(
        local, create=True, push_to=str(tmp_path / "remote"), auto_compact=False, **KNOBS
    ) as store:
        fill(store, "r", [1, 2, 3])
        assert store.wait_pushed(timeout=60)
    real = evict_module.Proof.holds
    removed: list[bool] = []

    def holds(self: Any, found: Any, ids: Any) -> bool:
        ok = real(self, found, ids)
        if not removed:
            with ckstore.open(local) as other:
                other.remove_remote("tier")
            removed.append(True)
        return ok

    monkeypatch.setattr(evict_module.Proof, "holds", holds)
    store = ckstore.open(local, push_to="tier", local_budget=0, auto_compact=False, **KNOBS)
    try:
        with pytest.raises(NotFoundError, match="'tier' is no longer one of this store's"):
            store.wait_pushed(timeout=60)
        assert removed and store.last_eviction is not None
        assert store.last_eviction.chunks_evicted == 0
    finally:
        store.close()
    with ckstore.open(local) as plain:
        assert plain.remotes() == [] and plain.repository.index.remote_pack_ids() == {}
        assert all(restores(plain, f"r@{i}", i) for i in (1, 2, 3))
        assert plain.check(read_data=True).ok


def test_on_postgresql_a_remote_removed_beside_an_eviction_waits_for_it_and_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg: Any
) -> None:
    """PostgreSQL runs the two transactions side by side (SQLite serialises its writers): the
    removal must wait for the switch and then count the chunks it evicted, not delete the remote
    under them."""
    import threading

    from ckstore.errors import ConflictError
    from ckstore.index import tiering

    local, index = tmp_path / "local", pg.new_database()
    with ckstore.open(
        local,
        index=index,
        create=True,
        push_to=str(tmp_path / "remote"),
        auto_compact=False,
        **KNOBS,
    ) as store:
        fill(store, "r", [1, 2, 3])
        assert store.wait_pushed(timeout=60)
    real, inside, go = tiering._remote_kept, threading.Event(), threading.Event()

    def kept_then_held(conn: Any, remote: str) -> bool:
        found = real(conn, remote)
        if not inside.is_set():  # the first switch holds its transaction open
            inside.set()
            assert go.wait(60)
        return found

    monkeypatch.setattr(tiering, "_remote_kept", kept_then_held)
    outcome: list[BaseException | None] = []

    def remove() -> None:
        with ckstore.open(local, index=index) as other:
            try:
                other.remove_remote("tier")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

    store = ckstore.open(
        local, index=index, push_to="tier", local_budget=0, auto_compact=False, **KNOBS
    )
    try:
        assert inside.wait(60)
        remover = threading.Thread(target=remove)
        remover.start()
        remover.join(1.0)  # it waits on the switch's lock (without it: it deletes at once)
        go.set()
        remover.join(60)
        assert store.wait_pushed(timeout=60)
    finally:
        go.set()
        store.close()
    assert len(outcome) == 1 and isinstance(outcome[0], ConflictError), outcome
    with ckstore.open(local, index=index) as plain:
        assert [r.name for r in plain.remotes()] == ["tier"]
        assert all(restores(plain, f"r@{i}", i) for i in (1, 2, 3))
