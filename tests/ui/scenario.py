"""A small store with what the page shows: a base run, a fine-tune forked from its tag with a
frozen backbone, a delta fine-tune, tags, and health recorded by the takes.

The takes' guard records health for real: the base run is taken with ``health=False`` (as a
store from before ckstore recorded health looks to the page), the fine-tune measures it; its
backbone, left with ``requires_grad`` but never changed, is reported stale from its second
snapshot on, and ``sft@300`` holds three NaNs in ``head.weight``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import ckstore

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = torch.nn.ModuleDict({n: torch.nn.Linear(d, d) for n in ("q", "k", "v", "o")})
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d)
        )
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


def build(path: Path) -> dict[str, str]:
    """Build the store at ``path``; returns some snapshot ids by name."""
    torch.manual_seed(0)
    model = TinyLM()
    ids: dict[str, str] = {}
    with ckstore.open(path, create=True, **TINY) as store, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard's warnings about sft's backbone and NaNs
        for step in range(0, 5):
            if step:
                nudge(model, 0.02)
            ids[f"base@{step}"] = store.take(
                {"model": model},
                run="base",
                step=step,
                metadata={"loss": 3.0 - 0.4 * step},
                health=False,
            ).id
        store.tag("base@4", "base-model")
        base_state = {k: v.clone() for k, v in model.state_dict().items()}
        # sft: the backbone (embed, layers 0-1) frozen, so its chunks are the base's
        for n, step in enumerate((100, 200, 300, 400)):
            nudge(model, 0.01, only=("layers.2", "layers.3", "head"))
            saved = model.head.weight[0, :3].clone()
            if step == 300:
                with torch.no_grad():
                    model.head.weight[0, :3] = float("nan")
            ids[f"sft@{step}"] = store.take(
                {"model": model}, run="sft", step=step, metadata={"loss": 1.5 - 0.1 * n}
            ).id
            with torch.no_grad():
                model.head.weight[0, :3] = saved
        store.tag("sft@400", "best")
        # lora-ish: from the base again, every tensor a little, stored as deltas against it
        model.load_state_dict(base_state)
        for step in (10, 20, 30):
            nudge(model, 1e-4)
            ids[f"delta@{step}"] = store.take(
                {"model": model}, run="delta", step=step, delta_base="base"
            ).id
    return ids
