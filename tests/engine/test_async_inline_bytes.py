"""An async take stores a small tensor as it was at the call whatever the store's
``inline_bytes``: one of at most ``inline_bytes`` bytes is stored inside the manifest, read when
the take is planned, so its copy is made at once. Before, the choice went by its room in the
staging arena (rounded up to 64 bytes): with an ``inline_bytes`` not a multiple of 64 such a
tensor's copy was left to the filler threads and planning read its room first, storing zeros
or the previous take's bytes without a word."""

from __future__ import annotations

from pathlib import Path

import torch

import ckstore


def test_small_tensor_between_inline_and_its_arena_room_is_stored_as_at_the_call(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "store", inline_bytes=100, create=True)
    try:
        for step in range(1, 4):
            small = torch.full((25,), float(step))  # 100 bytes: inline; its room is 128 bytes
            big = torch.ones(10 << 20)  # 40 MiB: copied on a filler thread, not at once
            state = ckstore.StateDict(small=small, big=big)
            pending = store.async_take({"s": state}, run="r", step=step)
            snap = pending.wait(120)
            got = snap.read_object("s/small")
            assert torch.equal(got, torch.full((25,), float(step))), (step, got[:4])
    finally:
        store.close()


def test_an_optimizers_step_counter_is_stored_as_at_the_call(tmp_path: Path) -> None:
    """The same with a training job's state: Adam's per-parameter ``step`` (a 4-byte tensor,
    inline under inline_bytes=16, room 64 bytes) beside a 40 MiB parameter."""
    store = ckstore.open(tmp_path / "store", inline_bytes=16, create=True)
    try:
        model = torch.nn.Linear(2560, 4096, bias=False)  # 40 MiB of weights
        opt = torch.optim.Adam(model.parameters())
        steps = []
        for step in range(1, 4):
            model(torch.ones(1, 2560)).sum().backward()
            opt.step()
            pending = store.async_take({"model": model, "optim": opt}, run="r", step=step)
            snap = pending.wait(120)
            steps.append(float(snap.read_object("optim/state/0/step")))
        assert steps == [1.0, 2.0, 3.0]
    finally:
        store.close()
