"""``ckstore.TakeInterval``: the steps between takes picked from measured step and take costs
(a fake clock makes every figure exact), and driving a real loop of async takes."""

from __future__ import annotations

import math

import pytest
import torch

import ckstore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Done:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def _steps(every: ckstore.TakeInterval, clock: Clock, seconds: list[float]) -> list[bool]:
    """One due() per step of the given durations (the first call only starts the clock)."""
    out = []
    for s in seconds:
        clock.now += s
        out.append(every.due())
    return out


def test_the_interval_follows_the_take_cost_and_the_overhead_budget():
    clock = Clock()
    every = ckstore.TakeInterval(overhead=0.02, start=5, window=3, clock=clock)
    assert _steps(every, clock, [1.0] * 5) == [False] * 4 + [True]
    assert every.interval == 5 and every.take_seconds is None and every.share() is None
    # the take blocks 0.5 s in the step after it and slows the next two by 0.25 s each
    assert _steps(every, clock, [1.5, 1.25, 1.25]) == [False] * 3
    assert every.step_seconds == 1.0 and every.take_seconds == pytest.approx(1.0)
    assert every.interval == math.ceil(1.0 / (0.02 * 1.0)) == 50
    assert every.share() == pytest.approx(1.0 / 51)
    state = every.state()
    assert state["interval"] == 50 and state["takes"] == 1 and state["overhead"] == 0.02


def test_a_cheaper_take_brings_the_interval_down_by_the_moving_average():
    clock = Clock()
    every = ckstore.TakeInterval(
        overhead=0.1, start=2, window=1, smoothing=0.5, min_steps=2, clock=clock
    )
    _steps(every, clock, [1.0, 1.0])  # a take is due at the second step
    _steps(every, clock, [3.0])  # it cost 2 s: 2 / (0.1 * 1) = 20 steps
    assert every.interval == 20
    due = _steps(every, clock, [1.0] * 19)
    assert due[-1] and not any(due[:-1])
    _steps(every, clock, [1.0])  # cost 0: the average halves
    assert every.take_seconds == pytest.approx(1.0) and every.interval == 10
    _steps(every, clock, [1.0] * 9)
    _steps(every, clock, [1.0])
    assert every.interval == 5


def test_a_take_handle_keeps_its_cost_counting_until_it_is_done_and_takes_never_overlap():
    clock = Clock()
    every = ckstore.TakeInterval(overhead=0.5, start=2, window=1, clock=clock)
    _steps(every, clock, [1.0, 1.0])
    pending = Done()
    every.taking(pending)
    # the take's background runs for six steps: no next take is due meanwhile
    assert _steps(every, clock, [1.1] * 6) == [False] * 6
    assert every.take_seconds is None  # still running: its cost is not known yet
    pending.finished = True
    assert _steps(every, clock, [1.1]) == [True]  # done, and the interval has passed
    assert every.take_seconds == pytest.approx(0.7)
    assert every.interval == 7  # 0.7 / (0.5 * 1) would be 2, but the take ran 7 steps


def test_bounds_and_arguments():
    clock = Clock()
    every = ckstore.TakeInterval(overhead=0.01, start=3, max_steps=4, window=1, clock=clock)
    _steps(every, clock, [1.0, 1.0, 1.0, 100.0])
    assert every.interval == 4  # capped
    for bad in (
        {"overhead": 0},
        {"overhead": 1.5},
        {"min_steps": 0},
        {"min_steps": 5, "max_steps": 4},
        {"start": 0},
        {"window": 0},
        {"smoothing": 0},
    ):
        with pytest.raises(ckstore.InvalidInputError):
            ckstore.TakeInterval(**bad)


def test_a_loop_of_async_takes_at_the_interval_commits_every_take(store):
    state = ckstore.StateDict(w=torch.zeros(256), step=0)
    every = ckstore.TakeInterval(overhead=0.5, start=3, max_steps=5)
    taken = []
    for step in range(1, 25):
        state["w"].add_(1.0)
        state["step"] = step
        if every.due():
            pending = store.async_take({"m": state}, run="loop", step=step)
            every.taking(pending)
            taken.append((step, pending))
            pending.wait(timeout=60)  # a loop faster than a take: no take is due before it ends
    assert len(taken) >= 4  # the first at step 3, then at most 5 steps apart
    for step, pending in taken:
        snap = pending.wait(timeout=60)
        assert snap.step == step and snap.read_object("m/step") == step
        assert torch.equal(snap.read_object("m/w"), torch.full((256,), float(step)))
    assert 3 <= every.interval <= 5
