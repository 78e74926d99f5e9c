"""Stateful helpers, as in TorchSnapshot: ``StateDict`` and ``RNGState``."""

from __future__ import annotations

import random
from collections import UserDict
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, ..."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class StateDict(UserDict[str, Any]):
    """A dict that is its own state: wrap plain values (step counters, configs, tensors).

    ``state_dict()`` returns the dict itself, so a restore copies into the tensors it holds.
    """

    def state_dict(self) -> dict[str, Any]:
        return self.data

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data.update(state_dict)


class RNGState:
    """The random number generators' state: torch (CPU and every CUDA device), ``random``, NumPy.

    Taking a snapshot records the state at that moment; restoring puts every generator back, so
    a resumed run draws the same numbers as an uninterrupted one.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "random": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        version, internal, gauss = state_dict["random"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state_dict["numpy"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state_dict["cuda"]))
