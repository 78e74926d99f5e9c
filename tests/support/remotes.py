"""Helpers of the remote tests: states whose content is a function of the step, and checks that
two stores hold the same history, bit for bit (importable from worker processes too)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ckstore

KNOBS = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def state_for(step: int, changed: float = 1.0) -> dict[str, torch.Tensor]:
    """A state that is a function of ``step``: ``fresh`` changes every step, ``slow`` every 4
    steps (dedup across snapshots), ``drift`` a little every step (what deltas are for)."""
    g = torch.Generator().manual_seed(step)
    base = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    return {
        "fresh": torch.randn(24, 32, generator=g),
        "slow": torch.randn(40, 32, generator=torch.Generator().manual_seed(step // 4)),
        "drift": base
        + 1e-3 * torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 + step)),
        "ints": torch.arange(300, dtype=torch.int64) * step,
    }


def app(step: int) -> dict[str, Any]:
    return {"m": ckstore.StateDict(state_for(step))}


def fill(
    store: ckstore.Store,
    run: str,
    steps: Iterable[int],
    tags: Mapping[int, Sequence[str]] | None = None,
    **kw: Any,
) -> list[ckstore.StoredSnapshot]:
    """Take ``state_for(step)`` for each step into ``run``."""
    return [
        store.take(app(step), run=run, step=step, tags=list((tags or {}).get(step, ())), **kw)
        for step in steps
    ]


def fill_evicted(local: Path, remote: Path, steps: Iterable[int] = range(1, 7)) -> str:
    """A store at ``local`` whose tier is ``remote``, with ``state_for(step)`` taken into run
    ``r`` for each step under a local budget of four packs: pushed, and some of its chunks
    evicted (their rows point at the remote's packs). Returns its index URL."""
    with ckstore.open(
        local,
        create=True,
        push_to=str(remote),
        local_budget=4 * KNOBS["pack_bytes"],
        auto_compact=False,
        **KNOBS,
    ) as store:
        fill(store, "r", steps)
        assert store.wait_pushed(timeout=60) and store.repository.index.remote_pack_ids()
        return store.index_url


def restores(store: ckstore.Store, ref: str, step: int) -> bool:
    """Whether ``ref`` restores ``state_for(step)`` bit for bit."""
    want = state_for(step)
    out = {"m": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
    store.get(ref).restore(out)
    return all(torch.equal(out["m"][k], v) for k, v in want.items())


def history(store: ckstore.Store) -> list[tuple[Any, ...]]:
    """Every snapshot's id, run, step, parent, metadata and health figures, oldest first."""
    return sorted(
        (
            s.id,
            s.run,
            s.step,
            s.parent_id,
            tuple(sorted(s.metadata.items())),
            s.record.nonfinite,
            s.created_at,
        )
        for s in store.log()
    )


def same_history(a: ckstore.Store, b: ckstore.Store) -> bool:
    return history(a) == history(b) and a.tags() == b.tags()


def tiered(tmp_path: Path) -> ckstore.Store:
    """A store at ``tmp_path/local`` whose tier remote (``tier``, a folder at
    ``tmp_path/remote``) holds r@1, r@2 and r@3, pushed."""
    store = ckstore.open(tmp_path / "local", create=True, auto_compact=False, **KNOBS)
    store.add_remote("tier", tmp_path / "remote")
    store.repository.index.set_remote_tier("tier", True)
    fill(store, "r", [1, 2, 3])
    store.push("tier")
    assert {s.state for s in store.push_status().values()} == {"pushed"}
    return store
