"""The distributed restore: each rank reads only the region its destination needs.

A DTensor destination needs its shard's box of the global tensor (any placement, any world
size: the stored pieces are cut to that box); a plain tensor needs the whole tensor; a
per-rank entry gives each rank its own value. Every rank validates and reads first, then all
ranks compare outcomes: either every rank loads its state or every rank raises
:class:`DistributedError` with the destination untouched.

Replicated entries (a plain destination needing the whole tensor on every rank, as in DDP)
are read by every rank by default (``replicated_read="each"``). With ``"broadcast"`` rank 0
alone reads and verifies them and sends the verified bytes to the others over the gloo group;
the others read none of their chunks. Which is faster depends on the storage (a local or
shared file system serving many readers at once, or an object store with per-request
latency) against the interconnect; ``bench/replicated_read.py`` measures both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..engine.config import budget_cap
from ..engine.restore import Reader, apply, prepare, validate, whole_plain_keys
from ..errors import InvalidInputError
from ..format.manifest import TensorEntry
from ..format.tensors import empty_for
from .comm import Comm, phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

REPLICATED_READS = ("each", "broadcast")


def replicated_mode(value: str | None) -> str:
    """The replicated-read mode: the argument, else ``CKSTORE_REPLICATED_READ``, else "each"."""
    mode = value if value is not None else os.environ.get("CKSTORE_REPLICATED_READ", "each")
    if mode not in REPLICATED_READS:
        raise InvalidInputError(f"replicated_read must be one of {list(REPLICATED_READS)}, got {mode!r}")
    return mode


def restore(
    reader: Reader,
    app_state: Mapping[str, Any],
    strict: bool = True,
    pg: ProcessGroup | None = None,
    timeout: float | None = None,
    budget: int | None = None,
    replicated_read: str | None = None,
    atomic: bool = True,
) -> None:
    """Restore ``reader``'s snapshot into ``app_state`` on every rank of ``pg`` (see the module
    docstring); every rank loads, or every rank raises DistributedError."""
    mode = replicated_mode(replicated_read)
    comm = Comm(pg, timeout)
    reader = replace(reader, rank=comm.rank)
    if mode == "broadcast" and comm.world > 1:
        _restore_broadcast(comm, reader, app_state, strict, budget, atomic)
        return
    with phase(comm, "restore", f"distributed restore of {reader.where}"):
        prepared = prepare(reader, app_state, strict, budget, atomic=atomic)
    apply(prepared, reader)


def _restore_broadcast(
    comm: Comm, reader: Reader, app_state: Mapping[str, Any], strict: bool, budget: int | None, atomic: bool
) -> None:
    """Rank 0 reads the entries every rank needs whole; the others receive them by broadcast."""
    what = f"distributed restore of {reader.where}"
    with phase(comm, "restore (validate)", what) as ph:
        plans = validate(reader, app_state, strict)
        ph.send(whole_plain_keys(reader, plans))
    # Entries needed whole everywhere, in one order on every rank (the manifest is the same).
    shared = sorted(set.intersection(*(set(whole) for whole in ph.received)))
    entries = {k: reader.manifest.entries[k] for k in shared}
    nbytes = sum(_nbytes(e) for e in entries.values())
    # Broadcast stages whole replicated tensors: by default up to the fixed cap, not the share
    # of the restored bytes that bounds the staging of verified chunks.
    budget = budget_cap() if budget is None else budget
    if nbytes > budget:
        shared, entries, nbytes = [], {}, 0  # broadcast stages whole tensors: over budget, each rank reads
    tensors: dict[str, torch.Tensor] = {}
    with phase(comm, "restore", what):
        prepared = prepare(reader, app_state, strict, budget - nbytes, plans=plans, skip=frozenset(shared), atomic=atomic)
        if comm.rank == 0:
            tensors = reader.read_tensors(shared)
    if comm.rank != 0:
        for k, e in entries.items():
            assert isinstance(e, TensorEntry)
            tensors[k] = empty_for(e.dtype, e.shape)
    comm.broadcast_tensors([tensors[k] for k in shared], "restore (broadcast of replicated entries)")
    prepared.tensors.update(tensors)
    apply(prepared, reader)


def _nbytes(entry: Any) -> int:
    assert isinstance(entry, TensorEntry)
    return math.prod(entry.shape) * empty_for(entry.dtype, (0,)).element_size()
