"""A distributed ``async_take`` copies into the staging arena its last take gave back.

Real ranks (gloo on CPU, forked): a training loop's async takes on every rank, the state moving
on after each call. Each snapshot holds the state at its call, bit for bit, and from the
second take on the copies go into memory already touched (one arena made per rank in all);
past the staging budget each tensor is copied on its own, as before, and nothing is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckstore
from tests.support.ranks import run_ranks, values
from tests.support.states import bits

TINY = {"chunk_bytes": 4096, "pack_bytes": 1 << 16, "inline_bytes": 64}
STEPS = 3


def _state(rank: int) -> dict[str, ckstore.StateDict]:
    gen = torch.Generator().manual_seed(rank)
    return {
        "mine": ckstore.StateDict(
            w=torch.randn(64, 32, generator=gen), b=torch.randn(100, generator=gen), step=rank
        ),
        "shared": ckstore.StateDict(r=torch.arange(4096, dtype=torch.float32).reshape(64, 64)),
    }


def _tensors(app: dict[str, ckstore.StateDict]) -> dict[str, torch.Tensor]:
    return {
        f"{name}/{k}": v for name, sd in app.items() for k, v in sd.items() if torch.is_tensor(v)
    }


def _loop(
    rank: int,
    world: int,
    path: str,
    budget: int | None,
    overlap: bool = False,
    prepare: bool = False,
) -> dict[str, Any]:
    from ckstore.engine.take import staging

    made: list[int] = []
    real = staging.StagingArena.__init__

    def counted(self: Any, nbytes: int, *args: Any, **kwargs: Any) -> None:
        made.append(nbytes)
        real(self, nbytes, *args, **kwargs)

    staging.StagingArena.__init__ = counted  # type: ignore[method-assign]
    store = ckstore.open(path, **TINY, create=True)
    if budget is not None:
        store.staging_budget = budget
    app = _state(rank)
    refused = ""
    meta = {"broken": ckstore.StateDict(m=torch.empty(1 << 28, device="meta"))}
    try:  # refused before any copy: nothing allocated for its 1 GiB, nothing kept half done
        store.async_take(app | meta, run="loop", step=99, replicated=["shared/*"])
    except ckstore.UnsupportedValueError as exc:
        refused = str(exc)
    if prepare:  # a job that readies its staging memory once its model exists
        store.prepare_staging(app).result(60)
    want: list[dict[str, bytes]] = []
    pending: list[Any] = []
    for step in range(STEPS):
        pending.append(store.async_take(app, run="loop", step=step, replicated=["shared/*"]))
        want.append({k: bits(v) for k, v in _tensors(app).items()})
        for t in _tensors(app).values():
            t.add_(1.0)  # training moves on at once: the snapshot keeps the state at the call
        if not overlap:  # else the next take starts while this one is still running
            pending[-1].wait(120)
    for p in pending:
        p.wait(120)
    for step in range(STEPS):
        dest = _state(rank)
        for t in _tensors(dest).values():
            t.zero_()
        store.get(f"loop@{step}").restore(dest)
        got = {k: bits(v) for k, v in _tensors(dest).items()}
        assert got == want[step], (rank, step)
    kept = store.repository.spare_staging.held()
    store.close()
    return {"arenas": len(made), "kept": kept, "refused": refused}


def test_a_training_loops_async_takes_reuse_one_arena_per_rank(tmp_path: Path) -> None:
    res = values(run_ranks(_loop, 2, tmp_path, str(tmp_path / "store"), None, timeout=240))
    assert [r["arenas"] for r in res] == [1, 1]  # made by the first take, reused by the next two
    assert all(r["kept"] for r in res)
    assert all("'broken/m'" in r["refused"] and "meta tensor" in r["refused"] for r in res)


def test_prepare_staging_readies_the_memory_of_a_ranks_first_async_take(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    res = values(run_ranks(_loop, 2, tmp_path, path, None, False, True, timeout=240))
    assert [r["arenas"] for r in res] == [1, 1]  # the prepared one, used by every take


def test_takes_started_before_the_last_one_finished_each_get_their_own(tmp_path: Path) -> None:
    res = values(run_ranks(_loop, 2, tmp_path, str(tmp_path / "store"), None, True, timeout=240))
    assert all(1 <= r["arenas"] <= STEPS and r["kept"] for r in res)  # every snapshot bit-exact


def test_past_the_staging_budget_each_tensor_is_copied_alone(tmp_path: Path) -> None:
    res = values(run_ranks(_loop, 2, tmp_path, str(tmp_path / "store"), 1024, timeout=240))
    assert [r["arenas"] for r in res] == [0, 0] and not any(r["kept"] for r in res)
