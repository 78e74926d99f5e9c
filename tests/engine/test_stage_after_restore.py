"""A restarted job's first ``async_take``: the restore that resumed it readies the staging.

An ``async_take`` blocks while it copies the state; into memory it touched before (its last
take's arena) that runs at memory speed, into new memory at the speed the kernel zeroes pages
(4x slower here). A snapshot ``async_take`` took says so in its header (``async_take``); a
restore of it, in a new process, prepares the arena of the next ``async_take`` behind training
(knob ``stage_after_restore``), which that take then copies into.
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.take import single, staging
from ckstore.engine.take.spec import TakeSpec

KNOBS = {"chunk_bytes": 16 << 10, "pack_bytes": 256 << 10, "inline_bytes": 64}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(1024, generator=g)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(256, 256), "b": torch.zeros(1024)}


def _optim(fill: float = 0.5) -> dict[str, Any]:
    """An optimizer's state dict (what a training job restores and an evaluation does not)."""
    return {
        "state": {0: {"exp_avg": torch.full((256, 256), fill)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }


def _app(weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> dict[str, Any]:
    return {"m": ckstore.StateDict(weights), "o": ckstore.StateDict(optim)}


def _spy_arenas(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every arena an async take or a prepare gets, in order."""
    got: list[Any] = []
    real = staging.arena_for

    def spy(repo: Any, nbytes: int, pinned: bool = False, shared: bool = False) -> Any:
        arena = real(repo, nbytes, pinned, shared)
        got.append(arena)
        return arena

    monkeypatch.setattr(single, "arena_for", spy)
    return got


def _saved(path: Path, asynchronous: bool) -> None:
    with ckstore.open(path, create=True, **KNOBS) as store:
        app = _app(_state(), _optim())
        if asynchronous:
            store.async_take(app, run="r", step=1).wait(timeout=60)
        else:
            store.take(app, run="r", step=1)


def test_the_header_says_which_takes_were_asynchronous(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", create=True, **KNOBS) as store:
        app = {"m": ckstore.StateDict(_state())}
        sync = store.take(app, run="r", step=1)
        later = store.async_take(app, run="r", step=2).wait(timeout=60)
        assert "async_take" not in (sync.manifest.snapshot or {})
        assert (later.manifest.snapshot or {})["async_take"] is True


def test_the_flag_travels_with_a_pickled_or_evolved_take_description() -> None:
    spec = TakeSpec.of(run="r", step=3).evolve(step=4)
    from dataclasses import replace

    flagged = replace(spec, asynchronous=True)
    assert pickle.loads(pickle.dumps(flagged)).asynchronous is True
    assert flagged.evolve(step=5).asynchronous is True
    assert pickle.loads(pickle.dumps(spec)).asynchronous is False


def test_a_restore_of_an_async_take_readies_the_arena_the_next_one_copies_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path / "s", asynchronous=True)
    arenas = _spy_arenas(monkeypatch)
    with ckstore.open(tmp_path / "s", **KNOBS) as store:  # a restarted job
        state, optim = _zeros(), _optim(0.0)
        store.get("r").restore(_app(state, optim))
        assert torch.equal(state["w"], _state()["w"])
        prepared = store.repository.staging_prepared
        assert prepared is not None and prepared.result(timeout=60) == arenas[0].size
        want = {k: v.clone() for k, v in state.items()}
        pending = store.async_take(_app(state, optim), run="r", step=2)
        assert len(arenas) == 2 and arenas[1] is arenas[0]  # the prepared memory, no new block
        for t in state.values():
            t.mul_(-1)  # training goes on: the snapshot is the state at the call
        got = pending.wait(timeout=60).read_object("m")
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_an_async_take_waits_for_the_arena_a_restore_is_still_preparing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path / "s", asynchronous=True)
    arenas = _spy_arenas(monkeypatch)
    touching = threading.Event()
    release = threading.Event()
    real_touch = staging.StagingArena.touch

    def slow_touch(self: Any) -> None:
        touching.set()
        release.wait(timeout=30)
        real_touch(self)

    monkeypatch.setattr(staging.StagingArena, "touch", slow_touch)
    with ckstore.open(tmp_path / "s", **KNOBS) as store:
        state, optim = _zeros(), _optim(0.0)
        store.get("r").restore(_app(state, optim))
        assert touching.wait(timeout=30)
        threading.Timer(0.3, release.set).start()  # the prepare ends while the take waits
        pending = store.async_take(_app(state, optim), run="r", step=2)
        assert len(arenas) == 2 and arenas[1] is arenas[0]  # waited, and used it
        got = pending.wait(timeout=60).read_object("m")
        assert all(torch.equal(got[k], v) for k, v in _state().items())


WHY = ["a synchronous take", "the knob is off", "weights alone", "a read-only handle"]


@pytest.mark.parametrize("why", WHY)
def test_nothing_is_prepared_for_a_job_that_will_not_take_asynchronously(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Not after a synchronous take's snapshot, nor with the knob off, nor for an evaluation
    that restores the weights alone (no optimizer state: no training will follow), nor on a
    handle that cannot take at all."""
    _saved(tmp_path / "s", asynchronous=why != "a synchronous take")
    if why == "the knob is off":
        monkeypatch.setenv("CKSTORE_STAGE_AFTER_RESTORE", "0")
    arenas = _spy_arenas(monkeypatch)
    extra = {"read_only": True} if why == "a read-only handle" else {}
    with ckstore.open(tmp_path / "s", **KNOBS, **extra) as store:
        weights = _zeros()
        app = (
            {"m": ckstore.StateDict(weights)} if why == "weights alone" else _app(weights, _optim())
        )
        store.get("r").restore(app, strict=why != "weights alone")
        assert torch.equal(weights["w"], _state()["w"])
        assert store.repository.staging_prepared is None
        assert not store.repository.spare_staging.held() and arenas == []


def test_an_optimizer_state_one_level_down_counts_as_a_training_job(tmp_path: Path) -> None:
    """``StateDict(model=..., optim=opt.state_dict())``: one app holding both."""
    with ckstore.open(tmp_path / "s", create=True, **KNOBS) as store:
        app = {"t": ckstore.StateDict(model=_state(), optim=_optim())}
        store.async_take(app, run="r", step=1).wait(timeout=60)
    with ckstore.open(tmp_path / "s", **KNOBS) as store:
        store.get("r").restore({"t": ckstore.StateDict(model=_zeros(), optim=_optim(0.0))})
        prepared = store.repository.staging_prepared
        assert prepared is not None and prepared.result(timeout=60) > 0
