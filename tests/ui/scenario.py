"""A store with what the page shows, as a team's store looks after a week: a pretraining run
with its optimizer, a tagged base, fine-tunes of it, a run that diverged, one that stalled, and
one from before ckstore recorded health.

- ``pretrain`` (steps 0-30, AdamW): its last snapshot is tagged ``base``.
- ``sft-frozen``: restored from ``base``, embedding and first two blocks frozen
  (``requires_grad=False``), so it keeps the base's chunks for them; ``best`` tags its step 300.
- ``sft-full``: restored from ``base``, every tensor trains and no delta is stored: it shares
  nothing with the base, and its fork is known only because the take recorded the restore.
- ``lora-delta``: the base's weights copied by hand (no restore), stored as deltas against
  ``base``: its fork is found from the delta bases.
- ``diverged``: restored from ``base``; NaN appears in ``layers.3.mlp.0`` at step 300, and in
  every MLP weight (eight tensors) by step 400.
- ``stuck``: the base's weights copied by hand, backbone frozen, and its optimizer stops
  stepping after its first snapshot: the head is stale from step 1 on. Its first snapshot
  holds the base's backbone chunks as ``pretrain@30`` and every ``sft-frozen`` snapshot do:
  a tie the fork resolves to the earliest holder.
- ``legacy``: taken with ``health=False``, as a store from before ckstore recorded health
  looks to the page.

Deterministic: a fixed seed, a clock that reads one fixed time per take (a minute apart), and
session ids from a seeded generator, so the store (and the screenshots made from it) are the
same on every build. No background compaction runs.
"""

from __future__ import annotations

import random
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import ckstore

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
EPOCH = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: the frozen clock's first reading
RUNS = ("pretrain", "sft-frozen", "sft-full", "lora-delta", "diverged", "stuck", "legacy")
BACKBONE = ("embed", "layers.0", "layers.1")


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = torch.nn.ModuleDict({n: torch.nn.Linear(d, d) for n in ("q", "k", "v", "o")})
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d)
        )
        self.norm = torch.nn.LayerNorm(d)


class TinyLM(torch.nn.Module):
    """A toy transformer-shaped model: embedding, four blocks, a head (59 tensors)."""

    def __init__(self, d: int = 32, vocab: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, scale: float) -> float:
    """``steps`` optimizer steps on a made-up loss (later layers pulled harder); the loss."""
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(
            (p * torch.randn_like(p)).sum() * scale * (1 + _depth(name))
            for name, p in model.named_parameters()
            if p.requires_grad
        )
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return float(loss.detach().abs())


def nudge(model: torch.nn.Module, scale: float) -> None:
    """Change every parameter a little, in place (a fine-tune stored as deltas)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * scale * (1 + _depth(name)))


def _depth(name: str) -> int:
    return sum(name.startswith(f"layers.{i}") * i for i in range(4))


def freeze_backbone(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Freeze the embedding and the first two blocks; the parameters left to train."""
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(BACKBONE))
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def frozen_clock() -> Iterator[list[float]]:
    """``time.time`` reads ``clock[0]`` (advance it between takes), and ``uuid.uuid4`` draws
    from a seeded generator, until the block ends."""
    clock = [EPOCH]
    rng = random.Random(20260101)
    real_time, real_uuid4 = time.time, uuid.uuid4
    time.time = lambda: clock[0]
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)
    try:
        yield clock
    finally:
        time.time, uuid.uuid4 = real_time, real_uuid4


def build(path: Path) -> dict[str, str]:
    """Build the store at ``path``; returns every snapshot's id by ``run@step``."""
    torch.manual_seed(0)
    ids: dict[str, str] = {}
    with (
        ckstore.open(path, create=True, auto_compact=False, **TINY) as store,
        warnings.catch_warnings(),
        frozen_clock() as clock,
    ):
        warnings.simplefilter("ignore")  # the guard's warnings about the NaN and stale runs

        def take(app: dict[str, Any], run: str, step: int, **kw: Any) -> Any:
            clock[0] += 60.0
            snap = store.take(app, run=run, step=step, **kw)
            ids[f"{run}@{step}"] = snap.id
            return snap

        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in (0, 10, 20, 30):
            loss = train(model, opt, 2, 0.02) if step else 3.0
            take({"model": model, "optim": opt}, "pretrain", step, metadata={"loss": loss})
        store.tag("pretrain@30", "base")

        # sft-frozen: restored from the base, the backbone frozen (its chunks are the base's)
        model = TinyLM()
        store.get("base").restore({"model": model}, strict=False)
        opt = torch.optim.AdamW(freeze_backbone(model), lr=1e-2)
        for n, step in enumerate((100, 200, 300, 400)):
            train(model, opt, 1, 0.01)
            take({"model": model, "optim": opt}, "sft-frozen", step,
                 metadata={"loss": [1.9, 1.4, 1.1, 1.3][n]})  # fmt: skip
        store.tag("sft-frozen@300", "best")

        # sft-full: restored from the base, every tensor changes, nothing stored as a delta
        model = TinyLM()
        store.get("base").restore({"model": model}, strict=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for n, step in enumerate((100, 200, 300)):
            train(model, opt, 1, 0.01)
            take({"model": model, "optim": opt}, "sft-full", step,
                 metadata={"loss": [1.8, 1.2, 0.9][n]})  # fmt: skip
        base_weights = store.get("base").read_object("model")

        # lora-delta: the base's weights copied by hand, stored as deltas against the base
        model = TinyLM()
        model.load_state_dict(base_weights)
        for step in (10, 20, 30):
            nudge(model, 1e-4)
            take({"model": model}, "lora-delta", step, delta_base="base")

        # diverged: NaN in one layer at step 300, in every MLP by step 400
        model = TinyLM()
        store.get("base").restore({"model": model}, strict=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in (100, 200, 300, 400):
            train(model, opt, 1, 0.01)
            with torch.no_grad():
                if step == 300:
                    model.layers[3].mlp[0].weight[0, :3] = float("nan")
                if step == 400:
                    for block in model.layers:
                        block.mlp[0].weight[1, 0] = block.mlp[2].weight[1, 0] = float("nan")
            take({"model": model, "optim": opt}, "diverged", step)

        # stuck: the base copied by hand, backbone frozen, the optimizer stops after step 0
        model = TinyLM()
        model.load_state_dict(base_weights)
        opt = torch.optim.AdamW(freeze_backbone(model), lr=1e-2)
        train(model, opt, 1, 0.01)
        for step in (0, 1, 2):
            take({"model": model, "optim": opt}, "stuck", step)

        # legacy: no health recorded
        model = TinyLM()
        for step in (0, 1):
            nudge(model, 0.01)
            take({"model": model}, "legacy", step, health=False)
    return ids
