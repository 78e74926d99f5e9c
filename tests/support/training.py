"""A small model trained for real, for the guard's tests and bench: saves of a healthy run,
and the ways a run goes wrong (no optimizer step, a stale copy saved, a divergence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trainer:
    """An MLP with an optimizer and a deterministic data stream."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    gen: torch.Generator
    dim: int

    @classmethod
    def make(
        cls, dim: int = 64, seed: int = 0, optim: str = "adam", frozen_first: bool = False
    ) -> Trainer:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim),
            torch.nn.GELU(),
            torch.nn.LayerNorm(4 * dim),
            torch.nn.Linear(4 * dim, dim),
        )
        if frozen_first:  # a frozen backbone layer: must never be called stale
            for p in model[0].parameters():
                p.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt: torch.optim.Optimizer
        if optim == "adam":
            opt = torch.optim.AdamW(params, lr=1e-3)
        else:
            opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        return cls(model, opt, torch.Generator().manual_seed(seed + 1), dim)

    def train(self, steps: int = 3) -> float:
        loss = torch.tensor(0.0)
        for _ in range(steps):
            x = torch.randn(16, self.dim, generator=self.gen)
            loss = ((self.model(x) - x.flip(1)) ** 2).mean()
            self.optim.zero_grad()
            loss.backward()
            self.optim.step()
        return float(loss.detach())

    def forward_backward_only(self, steps: int = 3) -> None:
        """A training loop that forgot ``optimizer.step()``."""
        for _ in range(steps):
            x = torch.randn(16, self.dim, generator=self.gen)
            self.optim.zero_grad()
            ((self.model(x) - x) ** 2).mean().backward()

    def app_state(self) -> dict[str, object]:
        return {"model": self.model, "optim": self.optim}
