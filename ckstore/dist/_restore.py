"""The distributed restore: each rank reads only the region its destination needs.

A DTensor destination needs its shard's box of the global tensor (any placement, any world
size: the stored pieces are cut to that box); a plain tensor needs the whole tensor; a
per-rank entry gives each rank its own value. Every rank validates and reads first, then all
ranks compare outcomes: either every rank loads its state or every rank raises
:class:`DistributedError` with the destination untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .._restore import Reader, apply, prepare
from ._comm import Comm, failure, raise_failed


def restore(
    reader: Reader,
    app_state: Mapping[str, Any],
    strict: bool = True,
    pg: Any = None,
    timeout: float | None = None,
    budget: int | None = None,
) -> None:
    comm = Comm(pg, timeout)
    reader = replace(reader, rank=comm.rank)
    prepared = None
    try:
        prepared = prepare(reader, app_state, strict, budget)
        msg: dict[str, Any] = {"ok": True}
    except Exception as exc:
        msg = failure(exc)
    raise_failed(comm.all_gather_json(msg, "restore"), f"distributed restore of {reader.where}")
    assert prepared is not None
    apply(prepared, reader)
