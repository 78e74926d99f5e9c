"""How often to take: the steps between takes picked from measured costs (CheckFreq's idea).

A take costs a training job what it blocks for plus what the steps while its background work
runs lose; spread over ``k`` steps of ``t`` seconds each, that is ``cost / (k * t)`` of the
wall clock. :class:`TakeInterval` measures both from the loop itself and keeps ``k`` at the
smallest interval whose share stays within an overhead budget (say 2%): frequent takes where
they are cheap, fewer where they are not, adapting as either changes.

It needs one call per training step, so a plain loop, a Lightning callback and a Hugging Face
callback drive it alike (``ckstore.integrations``); it never touches a store.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .errors import InvalidInputError


class _Pending(Protocol):
    def done(self) -> bool: ...


class TakeInterval:
    """The number of steps between takes that keeps checkpointing within ``overhead`` of the
    wall clock, from the step and take costs measured as the loop runs.

    ::

        every = ckstore.TakeInterval(overhead=0.02)
        for step, batch in enumerate(loader):
            train_step(batch)
            if every.due():
                every.taking(store.async_take(app_state, run="sft", step=step))

    :meth:`due` is called once per step, after it: it times the step (from its previous call)
    and says whether a take is due now. A step is *clean* when no take's cost falls in it; the
    mean of the recent clean steps is the base step time. A take's cost is what the steps from
    the take on took beyond the base: the one that began with it (its blocking), and the next
    ones until its background work is done (:meth:`taking` gives the handle; without one,
    ``window`` steps). The interval is then ``ceil(cost / (overhead * base))`` steps, at least
    the steps the take's background work ran (takes never overlap), within
    ``[min_steps, max_steps]``; the cost is a moving average over takes (``smoothing``). While
    the last take is still running, no next one is due (two would need two staging copies).

    Args:
        overhead: the share of the wall clock checkpointing may cost, in (0, 1).
        start: the interval until a take's cost is measured.
        min_steps: the smallest interval.
        max_steps: the largest interval.
        window: steps a take's cost is counted over when :meth:`taking` was not told its
            handle (and at least this many when it was).
        smoothing: weight of the newest take's cost in the moving average, in (0, 1].
        clock: seconds, monotonic (tests pass a fake one).

    Raises:
        InvalidInputError: an argument out of range (the message names it).
    """

    def __init__(
        self,
        overhead: float = 0.02,
        *,
        start: int = 10,
        min_steps: int = 1,
        max_steps: int = 100_000,
        window: int = 10,
        smoothing: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0.0 < overhead < 1.0:
            raise InvalidInputError(f"overhead must be in (0, 1), got {overhead!r}")
        if not 1 <= min_steps <= max_steps:
            raise InvalidInputError(
                f"need 1 <= min_steps <= max_steps, got {min_steps!r} and {max_steps!r}"
            )
        if not min_steps <= start <= max_steps or window < 1:
            raise InvalidInputError(
                f"start must be within [min_steps, max_steps] and window at least 1, got "
                f"start={start!r}, window={window!r}"
            )
        if not 0.0 < smoothing <= 1.0:
            raise InvalidInputError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.overhead = overhead
        self.min_steps, self.max_steps, self.window = min_steps, max_steps, window
        self.smoothing = smoothing
        self._clock = clock
        self._interval = start
        self._since = 0  # steps since the last take
        self._last: float | None = None  # the previous due() call
        self._clean: deque[float] = deque(maxlen=CLEAN_STEPS)
        self._counting: list[float] | None = None  # the steps of the take being costed
        self._pending: _Pending | None = None
        self._cost: float | None = None
        self._takes = 0

    @property
    def interval(self) -> int:
        """Steps from one take to the next, as chosen now."""
        return self._interval

    @property
    def step_seconds(self) -> float | None:
        """The base step time: the mean of the recent clean steps (None before any)."""
        return sum(self._clean) / len(self._clean) if self._clean else None

    @property
    def take_seconds(self) -> float | None:
        """What a take costs the loop, in seconds (the moving average; None before one was
        measured)."""
        return self._cost

    def share(self) -> float | None:
        """The share of the wall clock takes cost at the current interval (None before a take
        was measured)."""
        base = self.step_seconds
        if self._cost is None or not base:
            return None
        return self._cost / (self._interval * base + self._cost)

    def due(self) -> bool:
        """Call once per training step, after it: whether to take now.

        Times the step (since the previous call) into the base or into the cost of the take
        being measured, and re-picks the interval once a take's cost is known. True when
        ``interval`` steps passed since the last take and that take is done.
        """
        now = self._clock()
        if self._last is not None:
            self._record(now - self._last)
        self._last = now
        self._since += 1
        if self._since < self._interval or not self._finished():
            return False
        self._since = 0
        self._close()
        self._counting, self._pending = [], None
        self._takes += 1
        return True

    def taking(self, pending: _Pending | None) -> None:
        """Tell the take just started (``due()`` said True): its cost counts until
        ``pending.done()`` (a ``PendingSnapshot``, or any object with ``done()``), and at least
        ``window`` steps. None leaves it at ``window`` steps."""
        self._pending = pending

    def _finished(self) -> bool:
        """Whether the last take :meth:`taking` was told of is done (True when none was)."""
        return self._pending is None or self._pending.done()

    def _record(self, seconds: float) -> None:
        if self._counting is None:
            self._clean.append(seconds)
            return
        self._counting.append(seconds)
        if len(self._counting) >= self.window and self._finished():
            self._close()

    def _close(self) -> None:
        """End the cost window of the last take (if one is open) and re-pick the interval."""
        steps, self._counting = self._counting, None
        base = self.step_seconds
        if not steps or base is None:
            return
        cost = max(0.0, sum(steps) - len(steps) * base)
        a = self.smoothing
        self._cost = cost if self._cost is None else a * cost + (1 - a) * self._cost
        k = math.ceil(self._cost / (self.overhead * base)) if base > 0 else self.max_steps
        ran = len(steps) if self._pending is not None else 1
        self._interval = max(self.min_steps, min(self.max_steps, max(k, ran)))

    def state(self) -> dict[str, Any]:
        """The figures it decides from, JSON-able (for a log line or a dashboard)."""
        return {
            "interval": self._interval,
            "overhead": self.overhead,
            "step_seconds": self.step_seconds,
            "take_seconds": self._cost,
            "share": self.share(),
            "takes": self._takes,
        }

    def __repr__(self) -> str:
        return (
            f"TakeInterval(overhead={self.overhead}, interval={self._interval}, "
            f"step_seconds={self.step_seconds}, take_seconds={self._cost})"
        )


CLEAN_STEPS = 50
"""Recent clean steps the base step time is the mean of."""
