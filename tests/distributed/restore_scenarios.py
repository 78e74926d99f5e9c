"""What each rank runs in the read-once restore tests (imported in forked children)."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch

import ckstore
from ckstore import objects
from ckstore.errors import DistributedError
from tests.distributed import scenarios as sc
from tests.support.states import bits

TENSORS = 64
ROWS = 64  # 64 x 64 float32 = 16 KiB per tensor, 1 MiB in all (4 KiB chunks: 4 per tensor)
SMALL = {"chunk_bytes": 4096, "pack_bytes": 1 << 16, "inline_bytes": 64}


def replicated_state() -> ckstore.StateDict:
    """The same tensors on every rank (data parallel, not declared replicated)."""
    gen = torch.Generator().manual_seed(7)
    return ckstore.StateDict(
        {f"w{i}": torch.randn(ROWS, 64, generator=gen) for i in range(TENSORS)}
    )


def zeros() -> ckstore.StateDict:
    return ckstore.StateDict({k: torch.zeros_like(v) for k, v in replicated_state().items()})


def _counting(path: str) -> tuple[ckstore.Store, objects.CountingBackend]:
    store = ckstore.open(path)
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    return store, counting


def _pack_bytes(counting: objects.CountingBackend) -> int:
    return sum(g.nbytes for g in counting.gets if g.name.startswith("packs/"))


def counted_restores(rank: int, world: int, path: str) -> dict[str, Any]:
    """Pack bytes each rank reads restoring the replicated state, per mode; bits checked."""
    store, counting = _counting(path)
    snap = store.get("rep")
    _ = snap.manifest
    want = replicated_state()
    out: dict[str, Any] = {}
    cases = {
        "each": {"replicated_read": "each"},
        "once, atomic=False": {"atomic": False},
        "once, atomic": {},
        "once, atomic, held": {"memory_budget": 1 << 30},
    }
    for name, kw in cases.items():
        dest = zeros()
        counting.reset()
        snap.restore({"s": dest}, **kw)
        out[name] = _pack_bytes(counting)
        assert all(bits(dest[k]) == bits(want[k]) for k in want), name
    return out


def resharded_restore(rank: int, world: int, path: str) -> dict[str, Any]:
    """Take DTensors on every rank, restore them into other placements: bytes read per rank."""
    store, counting = _counting(path)
    snap = store.take({"g": ckstore.StateDict(sc.dtensors(world, True, False))}, run="dt")
    dest = ckstore.StateDict(sc.dtensors(world, False, True))
    counting.reset()
    # the snapshot the take returned: rank 0's manifest is the one it built (keys in the state's
    # order), the others' the one read back (sorted keys); chunks are numbered alike anyway
    snap.restore({"g": dest}, memory_budget=1 << 30)  # a held plan: read once
    sc.check_global(dest)
    return {"read": _pack_bytes(counting)}


def logged_restore(rank: int, world: int, path: str) -> dict[str, Any]:
    """A slow rank 3: rank 0's progress lines name it."""
    os.environ["CKSTORE_PROGRESS_SECONDS"] = "0.4"
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("ckstore")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    store = ckstore.open(path)
    if rank == 3:
        real = store.repository.objects.verify_chunk

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(0.03)
            return real(*a, **k)

        store.repository.objects.verify_chunk = slow  # type: ignore[method-assign]
    store.get("rep").restore({"s": zeros()}, atomic=False)
    return {"lines": [x for x in lines if "slowest rank" in x]}


def stopped_restore(
    rank: int, world: int, path: str, how: str, where: str, timeout: float
) -> dict[str, Any]:
    """Rank 2 is stopped or killed in the phase ``where`` of a restore; the others report.

    ``"read"``: at its first chunk read (a held plan: the whole exchange is in that phase);
    ``"broadcast"``: in the second round of a streamed exchange (atomic, default budget).
    """
    from ckstore.distributed import _exchange, _readplan

    _readplan.ROUND_BYTES = 64 << 10  # several rounds
    store = ckstore.open(path)
    if rank == 2:

        def stop() -> None:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

        if where == "read":

            def first_read(*a: Any, **k: Any) -> Any:
                stop()

            store.repository.objects.verify_chunk = first_read  # type: ignore[method-assign]
            store.repository.objects.check_payloads = first_read  # type: ignore[method-assign]
        else:
            real_round = _exchange.Exchange._round

            def round_(self: Any, k: int) -> None:
                if k == 1 and self.step == "broadcast":
                    stop()
                real_round(self, k)

            _exchange.Exchange._round = round_  # type: ignore[method-assign]
    dest = zeros()
    budget = 1 << 30 if where == "read" else None
    t0 = time.monotonic()
    try:
        store.get("rep").restore({"s": dest}, memory_budget=budget, dist_timeout=timeout)
    except DistributedError as exc:
        return {
            "error": str(exc),
            "seconds": time.monotonic() - t0,
            "ranks": getattr(exc, "ranks", None),
            "untouched": all(float(t.abs().sum()) == 0.0 for t in dest.values()),
        }
    return {"error": None, "seconds": time.monotonic() - t0}


def metadata_reads(rank: int, world: int, path: str) -> dict[str, Any]:
    """Take sharded and per-rank state, then restore it, from a fresh handle, into the same and
    into other placements: what each rank read of the store, per restore."""
    store = ckstore.open(path)
    app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "local": sc.local_app(rank)}
    sid = store.take(app, run="meta").id
    out: dict[str, Any] = {"id": sid}
    for name, take_placements in (("same", True), ("other", False)):
        store, counting = _counting(path)  # nothing of the snapshot cached
        dest = ckstore.StateDict(sc.dtensors(world, take_placements, True))
        local = ckstore.StateDict(
            {
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
                for k, v in sc.local_app(rank).items()
            }
        )
        counting.reset()
        store.get("meta").restore({"g": dest, "local": local})
        sc.check_global(dest)
        sc.check_local(local, rank)
        out[name] = {
            "manifest_gets": sum(1 for g in counting.gets if g.name.startswith("manifests/")),
            "pack_gets": [
                [g.name, g.offset, g.length] for g in counting.gets if g.name.startswith("packs/")
            ],
            "lists": counting.list_calls,
        }
    return out
