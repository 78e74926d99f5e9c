"""Run a function on N real ranks (gloo on CPU, fork) and collect each rank's JSON result."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankResults(list[Any]):
    """Each rank's result (None: no report), with what the test can say of a rank that gave
    none: its exit code, and every thread's stack if it was still running near the deadline."""

    def __init__(self, results: list[Any], fates: dict[int, str]) -> None:
        super().__init__(results)
        self.fates = fates


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out: str,
    args: tuple[Any, ...],
    stacks_after: float,
) -> None:
    import torch
    import torch.distributed as dist

    # A rank that hangs says where: every thread's stack, shortly before the parent kills it.
    stacks = open(Path(out, f"rank{rank}.stacks"), "w")  # noqa: SIM115 - lives until os._exit
    faulthandler.dump_traceback_later(stacks_after, file=stacks)

    # A forked child must not enter the intra-op (OpenMP) pool the parent may have started:
    # its threads do not exist after fork, so the first parallel region would hang. One
    # intra-op thread per rank is also what 4 ranks on 2 cores should use.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "tb": traceback.format_exc(),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown collectives: a peer may be dead on purpose


def run_ranks(
    fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout: float = 120, silent: int = 0
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; rank results (None: no report).

    ``silent``: ranks expected never to report (stopped on purpose); stop waiting once the
    others have.
    """
    out = tmp / f"ranks-{fn.__name__}-{world}-{free_port()}"
    out.mkdir(parents=True)
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), str(out), args, max(1.0, timeout - 3)),
        nprocs=world,
        start_method="fork",
        join=False,
    )
    deadline = time.monotonic() + timeout
    if silent:
        while time.monotonic() < deadline and len(list(out.glob("rank*.json"))) < world - silent:
            time.sleep(0.2)
        deadline = min(deadline, time.monotonic() + 2)
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    results, fates = [], {}
    for r, p in enumerate(ctx.processes):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
        stacks = out / f"rank{r}.stacks"
        dumped = stacks.read_text() if stacks.exists() else ""
        fates[r] = f"exit code {p.exitcode}" + (
            f"; its threads near the deadline:\n{dumped}" if dumped else ""
        )
    return RankResults(results, fates)


def values(results: list[Any]) -> list[Any]:
    """Each rank's value; fails with every rank's traceback if any rank failed."""
    bad = [(r, x) for r, x in enumerate(results) if not x or not x["ok"]]
    fates = getattr(results, "fates", {})
    if bad:
        raise AssertionError(
            "\n".join(
                f"rank {r}: {x['tb'] if x else 'no report (' + fates.get(r, 'died') + ')'}"
                for r, x in bad
            )
        )
    return [x["value"] for x in results]
