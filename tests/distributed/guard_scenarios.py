"""The guard on real ranks: FSDP2-sharded parameters and moments (stale, NaN on one rank's
shard) through ``store.take`` and ``dcp.save``; run by ``test_guard_dist.py``."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import ckstore
from tests.distributed.scenarios import TINY, _fsdp


def sharded_guard(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import StorageWriter

    store = ckstore.open(path, **TINY, create=True)
    m, opt = _fsdp(7)  # trained one step
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.take({"model": m, "optim": opt}, run="fsdp", step=1)
        torch.manual_seed(11)
        m(torch.randn(4, 48)).sum().backward()
        opt.step()
        opt.zero_grad()
        healthy = store.take({"model": m, "optim": opt}, run="fsdp", step=2)
        m(torch.randn(4, 48)).sum().backward()  # ...and no optimizer step: everything stale
        stale = store.take({"model": m, "optim": opt}, run="fsdp", step=3)
        first_name, first = next(iter(m.named_parameters()))
        out["nan_in"] = f"model/{first_name}"
        local = first.to_local()
        if rank == world - 1 and local.numel():
            with torch.no_grad():
                local.view(-1)[-1] = float("nan")  # on one rank's shard only
        bad = store.take({"model": m, "optim": opt}, run="fsdp", step=4, on_stale="ignore")
        dcp.save({"model": m.state_dict()}, storage_writer=StorageWriter(store, run="dcp", step=1))
    out["records"] = [(s.record.stale, s.record.nonfinite) for s in (healthy, stale, bad)]
    out["stale_keys"] = sorted(stale.health.stale or ()) if rank == 0 else None  # type: ignore[union-attr]
    out["bad_keys"] = bad.health.bad_keys if rank == 0 else None  # type: ignore[union-attr]
    out["dcp_nonfinite"] = store.get("dcp").record.nonfinite
    out["params"] = sorted(f"model/{k}" for k, _ in m.named_parameters())
    out["warnings"] = sorted(
        {str(w.message).split(":")[2].strip() for w in caught if "ckstore" in str(w.message)}
    )
    return out
