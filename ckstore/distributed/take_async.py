"""The async distributed take: stage this rank's state now, take it with every rank behind
training, on one thread per process (:func:`background`), so that the ranks' takes run their
collectives in call order (``take.take`` does the rest)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..engine.repository import Repository
from ..engine.take.packing import TakeOptions
from ..engine.take.plan import state_dicts
from ..engine.take.single import await_prepared, reserved_bytes
from ..engine.take.spec import TakeSpec
from ..engine.take.staging import arena_for, arena_size, give_back, stage
from ._classify import ddp_apps
from .comm import Comm
from .take import Committed, take

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def take_async(
    repo: Repository, app_state: Mapping[str, Any], spec: TakeSpec, pg: ProcessGroup | None
) -> Future[Committed]:
    """Stage this rank's state now; take it with every rank in the background.

    The group is opened now (opening waits for every member), and the state copied; the take
    then runs on one background thread per process (:func:`background`), so the ranks' takes
    run their collectives in call order. When all of this rank's copies fit the staging budget
    (``spec.staging_budget``, else the repository's, less the take's own buffers as in a single
    process: ``single.reserved_bytes``), they go into the staging arena the repository's last
    async take gave back (memory already touched: a training loop's takes copy at memory speed
    from the second on), given back once the take is done; past the budget each tensor is
    copied into new memory that goes with the take (nothing is stored before returning).
    """
    comm = Comm(pg, spec.dist_timeout, purpose="async")
    comm.count()  # before anything can fail on this rank alone (see _plan)
    ddp = ddp_apps(app_state)
    states = state_dicts(app_state)
    budget = repo.staging_budget if spec.staging_budget is None else spec.staging_budget
    budget -= reserved_bytes(TakeOptions.of(repo), repo.background_threads, budget)
    nbytes, on_gpu = arena_size(states)
    await_prepared(repo)
    arena = arena_for(repo, nbytes, pinned=on_gpu) if 0 < nbytes <= budget else None
    try:
        try:
            staged = stage(states, arena=arena)
        finally:
            if arena is not None:
                arena.finish()  # every copy from a device has landed, even when one failed
    except BaseException:
        if arena is not None:
            give_back(repo, arena)
        raise

    def run() -> Committed:
        try:
            return take(repo, staged, spec, comm, ddp)
        finally:
            if arena is not None:  # nothing reads the copies any more: the next take reuses them
                give_back(repo, arena)

    return background().submit(run)


_BACKGROUND: list[ThreadPoolExecutor] = []


def background() -> ThreadPoolExecutor:
    """The one thread that runs this process's async distributed takes, in call order.

    One thread keeps the order of collectives the same on every rank.
    """
    if not _BACKGROUND:
        _BACKGROUND.append(
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckstore-dist-async")
        )
    return _BACKGROUND[0]


def _after_fork_in_child() -> None:
    """The parent's executor has no thread in a forked child: its takes would never run."""
    _BACKGROUND.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
