"""The model and data of the full-training scenario: a small GPT-style transformer (pre-norm
``nn.TransformerEncoder`` with a causal mask, untied output head) trained with AdamW on
deterministic synthetic token data, and the two checkpoint states taken from it.

- ``fp32_state``: the fp32 weights and the AdamW state (step, exp_avg, exp_avg_sq per param),
  keyed by parameter name, in the layout of :func:`ckbench.states.build_state`. Its tensors are
  the live ones (no copies): save it only between steps.
- ``bf16_weights``: a bfloat16 copy of the weights, as the bf16 model of a mixed-precision run
  holds next to its fp32 master weights. Weights only: the fp32 run is trained, not a bf16 one
  (bf16 matmuls on CPUs without native bf16 support are several times slower than fp32).

Every weight changes at every step (AdamW's decoupled weight decay moves even the embedding rows
of tokens that a batch does not contain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 384
    layers: int = 4
    heads: int = 6
    vocab: int = 4096
    seq: int = 64
    batch: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "cpu"
    """Where the model trains (the data is made on the CPU and moved there)."""


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` pre-norm causal transformer blocks, a final norm
    and an untied linear head over the vocabulary."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        block = nn.TransformerEncoderLayer(
            cfg.dim, cfg.heads, 4 * cfg.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(n, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=h.dtype, device=x.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


class TokenData:
    """Deterministic synthetic sequences with structure to learn: each next token is a fixed
    random successor of the current one with probability 0.75, else a uniform random token."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(cfg.seed + 1)
        self.succ = torch.randperm(cfg.vocab, generator=self.g)

    def batch(self) -> torch.Tensor:
        c = self.cfg
        out = torch.empty(c.batch, c.seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, c.vocab, (c.batch,), generator=self.g)
        noise = torch.randint(0, c.vocab, (c.batch, c.seq), generator=self.g)
        keep = torch.rand(c.batch, c.seq, generator=self.g) < 0.75
        for i in range(c.seq):
            out[:, i + 1] = torch.where(keep[:, i], self.succ[out[:, i]], noise[:, i])
        return out


class Trainer:
    """The model, its AdamW optimizer and the data; ``steps(n)`` trains n steps for real."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model = TinyGPT(cfg).to(cfg.device)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.data = TokenData(cfg)
        self.step = 0
        self.loss = float("nan")

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def steps(self, n: int) -> float:
        """Train ``n`` steps; the last loss."""
        self.model.train()
        for _ in range(n):
            xy = self.data.batch().to(self.cfg.device)
            logits = self.model(xy[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, self.cfg.vocab), xy[:, 1:].reshape(-1)
            )
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            self.loss = loss.item()
        return self.loss


def fp32_state(t: Trainer) -> dict[str, Any]:
    """The live fp32 weights and AdamW state, keyed by parameter name (valid after a step)."""
    named = list(t.model.named_parameters())
    state = {k: dict(t.opt.state[p]) for k, p in named}
    group = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in t.opt.param_groups[0].items()
        if k != "params"
    }
    group["params"] = [k for k, _ in named]
    return {
        "model": {k: p.detach() for k, p in named},
        "optim": {"state": state, "param_groups": [group]},
    }


def bf16_weights(t: Trainer) -> dict[str, Any]:
    """A bfloat16 copy of the current weights (a new tensor per parameter)."""
    return {"model": {k: p.detach().to(torch.bfloat16) for k, p in t.model.named_parameters()}}
