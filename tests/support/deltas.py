"""Helpers of the delta tests: a tiny drifting 'training run' and its restore check."""

from __future__ import annotations

from typing import Any

import torch

import ckstore

KNOBS = {"chunk_bytes": 4096, "pack_bytes": 32768, "inline_bytes": 64}


class App:
    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, Any]:
        return self.d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.d = d


def train(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """States of a tiny 'training run': every element drifts a little each save."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g)
    states = []
    for _ in range(steps):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        states.append(
            {"w": w.clone(), "wb": w.to(torch.bfloat16), "step": torch.tensor(len(states))}
        )
    return states


def take_all(
    store: ckstore.Store, states: list[dict[str, torch.Tensor]], run: str = "r", **kw: Any
) -> list[str]:
    return [store.take({"m": App(dict(s))}, run=run, step=i, **kw).id for i, s in enumerate(states)]


def restores(store: ckstore.Store, snap_id: str, ref: dict[str, torch.Tensor]) -> bool:
    out = {k: torch.zeros_like(v) for k, v in ref.items()}
    store.get(snap_id).restore({"m": App(out)})
    return all(torch.equal(out[k], ref[k]) for k in ref)


def depths(store: ckstore.Store) -> list[int]:
    return sorted(c.depth for c in store.repository.index.all_chunks())
