"""Bytes flipped on the wire (issue 34, item 4), through :mod:`tests.support.faultproxy`.

Two scenarios on a :class:`~tests.support.fault_report.FaultBench`:

- :func:`run_flipped_puts`: one bit of a PUT body (a whole object or a multipart part)
  flipped in transit. The server must refuse every such request (it checks the CRC32 the put
  carries), the put must go through on a later attempt, and the server must hold exactly the
  bytes written.
- :func:`run_flipped_store`: a take with flipped PUT bodies, then restores with flipped GET
  bodies. Every restore must return the tensors taken, bit for bit, or raise a ckstore error:
  never other values.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from pathlib import Path

from ckstore.errors import CkstoreError
from ckstore.objects import chunk_id
from tests.support.fault_report import (
    PART,
    RECOVER_MAX_ATTEMPTS,
    RECOVER_S3FS_RETRIES,
    FaultBench,
    FaultRow,
    RecordingBackend,
)
from tests.support.faultproxy import FLIP, Schedule


@dataclass
class Flips:
    """What the flipped requests met."""

    flipped: int = 0
    """Requests whose body (or whose answer's body) the proxy flipped."""
    refused: int = 0
    """Of the flipped PUTs, those the server answered with HTTP 400."""
    restores: int = 0
    exact: int = 0
    """Restores that returned every tensor bit for bit..."""
    rejected: int = 0
    """...and those that raised a ckstore error."""
    wrong: int = 0
    """Tensors restored with other values than were taken (must stay 0)."""
    errors: tuple[str, ...] = ()
    """The errors the rejected restores raised (type and message)."""


def run_flipped_puts(bench: FaultBench, seed: int = 7, objects: int = 12) -> tuple[FaultRow, Flips]:
    """``objects`` small puts and one multipart put, about half their PUT requests flipped."""
    row = FaultRow("flip-put", FLIP, bench.name)
    url = bench.fresh_url()
    backend = RecordingBackend(bench.through(url, RECOVER_MAX_ATTEMPTS, RECOVER_S3FS_RETRIES))
    rng = random.Random(seed)
    schedule = Schedule(
        seed=seed, faults=(FLIP,), rate=0.5, methods=frozenset({"PUT"}), max_in_a_row=2
    )
    with bench.faults(schedule, row):
        for _ in range(objects):
            data = rng.randbytes(rng.randrange(1000, 20000))
            row.count(backend.put, f"blob/{chunk_id(data)}", data)
        big = rng.randbytes(PART + (1 << 20))
        row.count(backend.put, f"big/{chunk_id(big)}", [big[: 3 << 20], big[3 << 20 :]])
        events = list(bench.proxy.events)
    bench.audit(url, backend.written, row)
    flips = Flips()
    for event in events:
        if event.fault == FLIP:
            flips.flipped += 1
            flips.refused += event.upstream_status == 400
    return row, flips


def run_flipped_store(
    bench: FaultBench, index_dir: Path, seed: int = 11, restores: int = 8
) -> tuple[FaultRow, Flips]:
    """A take whose PUT bodies are flipped at rate 0.3, then ``restores`` restores whose GET
    bodies are flipped at rate 0.3 (a new schedule each)."""
    import torch

    import ckstore

    row = FaultRow("flip-store", FLIP, bench.name)
    url = bench.fresh_url()
    index = f"sqlite:///{index_dir / f'index-{uuid.uuid4().hex[:8]}.db'}"
    gen = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(40, 30, generator=gen) for i in range(4)}
    tiny = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
    options = bench.options(RECOVER_MAX_ATTEMPTS)
    flips = Flips()
    with ckstore.open(url, index=index, storage_options=options, **tiny, create=True) as store:
        puts = Schedule(seed=seed, faults=(FLIP,), rate=0.3, methods=frozenset({"PUT"}))
        with bench.faults(puts, row):
            row.count(store.take, {"m": ckstore.StateDict(state)}, "r", 1)
            flips.flipped += len(bench.proxy.faults())
            flips.refused += sum(e.upstream_status == 400 for e in bench.proxy.faults())
        for i in range(restores):
            gets = Schedule(seed=seed + 1 + i, faults=(FLIP,), rate=0.3, methods=frozenset({"GET"}))
            dest = ckstore.StateDict({k: torch.zeros_like(v) for k, v in state.items()})
            bench.proxy.reset(gets)
            flips.restores += 1
            try:
                store.get("r@1").restore({"m": dest})
            except CkstoreError as exc:
                flips.rejected += 1
                flips.errors += (f"{type(exc).__name__}: {exc}",)
                continue
            finally:
                flips.flipped += len(bench.proxy.faults())
                bench.proxy.reset(Schedule(seed=0))
            wrong = sum(not torch.equal(dest[k], v) for k, v in state.items())
            flips.wrong += wrong
            flips.exact += wrong == 0
    return row, flips
