"""A small store with what the page shows: a base run, a fine-tune forked from its tag with a
frozen backbone, a delta fine-tune, tags, and health recorded in some manifests.

Health is recorded the way issue 25 is expected to (``manifest.snapshot["health"]``) by wrapping
the take's manifest header, since takes do not record it yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import ckstore
import ckstore.engine.spec as spec_module

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = torch.nn.ModuleDict({n: torch.nn.Linear(d, d) for n in ("q", "k", "v", "o")})
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.norm = torch.nn.LayerNorm(d)


class TinyLM(torch.nn.Module):
    """A toy transformer-shaped model: embedding, four blocks, a head (about 60 tensors)."""

    def __init__(self, d: int = 32, vocab: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)


def nudge(model: torch.nn.Module, scale: float, only: tuple[str, ...] = ()) -> None:
    """Change parameters in place, more in later layers (a heat map with a gradient)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only and not name.startswith(only):
                continue
            depth = 1 + sum(name.startswith(f"layers.{i}") * i for i in range(4))
            p.add_(torch.randn_like(p) * scale * depth)


def health(model: torch.nn.Module, stale: list[str], nan_key: str | None = None) -> dict[str, Any]:
    tensors = {
        f"model/{k}": {"nan": 3 if f"model/{k}" == nan_key else 0, "inf": 0, "norm": float(v.float().norm())}
        for k, v in model.state_dict().items()
    }
    return {"tensors": tensors, "stale": stale}


@contextlib.contextmanager
def recording(box: dict[str, Any]) -> Iterator[None]:
    """Takes inside record ``box["health"]`` (when set) in their manifest header."""
    original = spec_module.snapshot_header

    def header(**kw: Any) -> dict[str, Any]:
        out = original(**kw)
        if box.get("health") is not None:
            out["health"] = box["health"]
        return out

    spec_module.snapshot_header = header  # type: ignore[assignment]
    try:
        yield
    finally:
        spec_module.snapshot_header = original  # type: ignore[assignment]


def build(path: Path) -> dict[str, str]:
    """Build the store at ``path``; returns some snapshot ids by name."""
    torch.manual_seed(0)
    model = TinyLM()
    ids: dict[str, str] = {}
    box: dict[str, Any] = {}
    with ckstore.open(path, create=True, **TINY) as store, recording(box):
        for step in range(0, 5):
            if step:
                nudge(model, 0.02)
            ids[f"base@{step}"] = store.take({"model": model}, run="base", step=step,
                                             metadata={"loss": 3.0 - 0.4 * step}).id
        store.tag("base@4", "base-model")
        base_state = {k: v.clone() for k, v in model.state_dict().items()}
        # sft: the backbone (embed, layers 0-1) frozen, so its chunks are the base's
        frozen = [f"model/{k}" for k in model.state_dict() if k.startswith(("embed", "layers.0", "layers.1"))]
        for n, step in enumerate((100, 200, 300, 400)):
            nudge(model, 0.01, only=("layers.2", "layers.3", "head"))
            box["health"] = health(model, frozen if n else [], "model/head.weight" if step == 300 else None)
            ids[f"sft@{step}"] = store.take({"model": model}, run="sft", step=step,
                                            metadata={"loss": 1.5 - 0.1 * n}).id
        box["health"] = None
        store.tag("sft@400", "best")
        # lora-ish: from the base again, every tensor a little, stored as deltas against it
        model.load_state_dict(base_state)
        for step in (10, 20, 30):
            nudge(model, 1e-4)
            ids[f"delta@{step}"] = store.take({"model": model}, run="delta", step=step, delta_base="base").id
    return ids
