"""An async distributed take that fails on one rank before it is submitted (its staging raised)
left that rank one take behind on the shared async group: its next take ran the collectives of
the other ranks' previous one, and one snapshot was committed from two different steps, with no
error anywhere. The ranks now compare which take they run in its plan phase (run, step, name
and the take's number over the group): the ranks behind give up the take that has no partner,
the others plan again with their next one, and the takes after are in step again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckstore
from tests.support.ranks import run_ranks, values

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _state(rank: int, step: int) -> ckstore.StateDict:
    return ckstore.StateDict(w=torch.full((64,), float(100 * step + rank)), step=step)


def _scenario(rank: int, world: int, path: str) -> dict[str, Any]:
    import ckstore.distributed.take_async as dtake

    store = ckstore.open(path, **TINY, create=True)
    out: dict[str, Any] = {}
    if rank == 1:  # staging fails on this rank only (say, no memory left for the copies)
        real = dtake.stage
        calls = {"n": 0}

        def stage(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError("injected: cannot allocate the staging copy")
            return real(*a, **k)

        dtake.stage = stage
    first = None
    try:
        first = store.async_take({"m": _state(rank, 1)}, run="r", step=1, dist_timeout=20)
    except Exception as exc:  # a training loop that logs a failed save and trains on
        out["step1_call"] = f"{type(exc).__name__}: {exc}"
    second = store.async_take({"m": _state(rank, 2)}, run="r", step=2, dist_timeout=20)
    for name, pending in (("first", first), ("second", second)):
        if pending is None:
            continue
        try:
            snap = pending.wait(60)
            out[name] = {"id": snap.id, "step": snap.step}
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    try:  # every rank takes again: the group is usable again
        third = store.async_take({"m": _state(rank, 3)}, run="r", step=3, dist_timeout=20)
        out["third"] = third.wait(60).step
    except Exception as exc:
        out["third"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    snaps = [(s.step, s.id) for s in store.log("r")]
    out["log"] = snaps
    return out


def test_a_rank_whose_async_take_failed_to_stage_does_not_mix_steps(tmp_path: Path) -> None:
    """No snapshot holds two steps; rank 0's step 1 fails; steps 2 and 3 commit whole."""
    path = str(tmp_path / "store")
    ckstore.open(path, **TINY, create=True).close()
    res = values(run_ranks(_scenario, 2, tmp_path, path, timeout=150))
    print(res)
    with ckstore.open(path) as store:
        log = [(snap.step, snap.id[:12], snap.record.world_size) for snap in store.log("r")]
        print("committed:", log)
        for snap in store.log("r"):
            ws = [float(w[0]) for w in snap.read_object("m/w")]
            steps = snap.read_object("m/step")
            print(f"snapshot labelled step {snap.step}: m/w per rank {ws}, m/step {steps}")
            want = [100.0 * snap.step + r for r in range(len(ws))]
            assert ws == want, f"snapshot labelled step {snap.step} holds m/w {ws}, not {want}"
    assert "r@1 (number 1 here)" in res[0]["first"], (
        res
    )  # rank 0's step 1: no partner, not committed
    assert res[0]["second"]["step"] == res[1]["second"]["step"] == 2, res  # back in step
    assert res[0]["third"] == res[1]["third"] == 3, res
    with ckstore.open(path) as store:
        assert sorted(s.step for s in store.log("r")) == [2, 3]
