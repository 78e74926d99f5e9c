"""Retention keeps each run's newest healthy snapshot, so a run that went wrong rolls back.

The scenario of the guard: a run trains, diverges (NaN), keeps saving; ``gc --keep-last 2``
alone would drop every snapshot from before the divergence. With ``keep_healthy`` (the
default) the newest healthy one survives, ``run@healthy`` names it, and restoring it gives
the pre-divergence state bit for bit. A stale snapshot (the optimizer stopped stepping) is not
healthy either: the rollback goes past it to the last state that trained.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import ckstore
from tests.support.states import bits
from tests.support.training import Trainer

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _diverged_run(store: ckstore.Store) -> dict[str, bytes]:
    """Steps 1-3 healthy, then a NaN; returns the bits of the last healthy state."""
    t = Trainer.make()
    healthy: dict[str, bytes] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 7):
            t.train(2)
            if step == 4:
                with torch.no_grad():
                    t.model[0].weight[3, 5] = float("nan")  # the divergence
            store.take(t.app_state(), run="r", step=step)
            if step == 3:
                healthy = {k: bits(v) for k, v in t.model.state_dict().items()}
    return healthy


def test_rollback_after_divergence_under_keep_last_2(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    healthy = _diverged_run(store)
    assert [s.step for s in store.log("r", healthy=True)] == [3, 2, 1]
    report = store.gc(keep_last=2, grace_seconds=0)
    assert sorted(report.snapshots_dropped) == ["r@1", "r@2", "r@4"]
    assert [s.step for s in store.log("r")] == [6, 5, 3]
    target = store.get("r@healthy")
    assert target.step == 3 and target.healthy is True
    assert store.check(read_data=True).ok
    fresh = Trainer.make(seed=99)  # another model, restored in place
    target.restore(fresh.app_state())
    assert {k: bits(v) for k, v in fresh.model.state_dict().items()} == healthy
    assert target.verify_live(fresh.app_state()).ok
    store.close()


def test_keep_healthy_false_lets_the_policy_drop_it(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    _diverged_run(store)
    dry = store.gc(keep_last=2, keep_healthy=False, dry_run=True)
    assert sorted(dry.snapshots_dropped) == ["r@1", "r@2", "r@3", "r@4"]
    store.gc(keep_last=2, keep_healthy=False, grace_seconds=0)
    assert store.log("r", healthy=True) == []
    store.close()


def test_snapshots_without_health_are_unknown_not_unhealthy(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    for step in (1, 2, 3):
        store.take({"m": ckstore.StateDict(w=torch.randn(300))}, run="old", step=step, health=False)
    assert store.log("old", healthy=True) == []
    assert sorted(store.gc(keep_last=1, dry_run=True).snapshots_dropped) == [
        "old@1",
        "old@2",
    ]  # nothing to keep
    store.close()


def test_rollback_past_staleness(tmp_path: Path) -> None:
    """The optimizer stops stepping after step 2 (no NaN anywhere): steps 3-5 are stale, so
    ``r@healthy`` is step 2, retention keeps it under ``keep_last=1``, and it restores the
    last state that trained bit for bit."""
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    t = Trainer.make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 6):
            if step <= 2:
                t.train(2)
            else:
                t.forward_backward_only()  # gradients, but no optimizer step
            store.take(t.app_state(), run="r", step=step)
            if step == 2:
                trained = {k: bits(v) for k, v in t.model.state_dict().items()}
    assert all(s.record.stale and s.record.nonfinite == 0 for s in store.log("r")[:3])
    assert [s.step for s in store.log("r", healthy=True)] == [2, 1]
    report = store.gc(keep_last=1, grace_seconds=0)
    assert sorted(report.snapshots_dropped) == ["r@1", "r@3", "r@4"]
    target = store.get("r@healthy")
    assert target.step == 2 and target.healthy is True
    fresh = Trainer.make(seed=99)
    target.restore(fresh.app_state())
    assert {k: bits(v) for k, v in fresh.model.state_dict().items()} == trained
    store.close()
