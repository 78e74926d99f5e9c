"""What each rank runs in the interrupted distributed restore test (imported in forked ranks)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch

import ckstore
from ckstore.engine.restore import fetch
from tests.distributed import restore_scenarios as rs


def interrupted_restore(rank: int, world: int, path: str, budget: int | None) -> dict[str, Any]:
    """Ctrl-C arrives while the atomic restore puts its checked chunks into the caller's
    tensors; the interrupt is raised, and the destination is wholly restored."""
    store = ckstore.open(path)
    real_place = fetch._place  # noqa: SLF001
    timers: list[threading.Timer] = []
    main = threading.main_thread().ident or 0

    def place(*args: Any, **kwargs: Any) -> Any:
        if not timers:  # the first chunk put in place: Ctrl-C a moment later
            timers.append(threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)))
            timers[-1].start()
        time.sleep(0.02)  # a large state: putting it in place takes seconds
        return real_place(*args, **kwargs)

    fetch._place = place  # noqa: SLF001
    want, dest = rs.replicated_state(), rs.zeros()
    raised = None
    try:
        store.get("rep").restore({"s": dest}, memory_budget=budget)
    except BaseException as exc:  # noqa: BLE001 - reported
        raised = type(exc).__name__
    try:
        for t in timers:
            t.join()
        time.sleep(0.3)
    except KeyboardInterrupt:
        raised = raised or "after"
    restored = sum(torch.equal(dest[k], want[k]) for k in want)
    untouched = sum(float(dest[k].abs().sum()) == 0.0 for k in want)
    return {"raised": raised, "restored": restored, "untouched": untouched, "of": len(want)}
