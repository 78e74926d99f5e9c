"""Stateful helpers, as in TorchSnapshot: ``StateDict`` and ``RNGState``."""

from __future__ import annotations

import random
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import InvalidInputError, UnsupportedValueError


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

    As in TorchSnapshot, a take captures it before calling any other ``state_dict()`` and puts
    it back afterwards, and a restore loads it after every other ``load_state_dict()``: random
    numbers drawn by other statefuls while they save or load do not shift the stream, so the
    generators after a restore are exactly as they were after the take.
    CUDA generators are recorded when CUDA is initialised in this process; on restore, as many
    devices as both sides have are set.
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
            for device, state in enumerate(list(state_dict["cuda"])[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)


def check_app_state(app_state: Any, *, restoring: bool = False) -> None:
    """Refuse an app_state that is not a mapping of names to stateful objects.

    Every value needs ``state_dict()`` (and, when ``restoring``, ``load_state_dict()``).

    Raises:
        InvalidInputError: ``app_state`` is not a mapping, or a name is not a plain str.
        UnsupportedValueError: a value is not stateful (also a ``TypeError``, as in
            TorchSnapshot); the message names its key.
    """
    if not isinstance(app_state, Mapping):
        raise InvalidInputError(
            f"app_state must be a dict mapping names to stateful objects (with state_dict() and "
            f"load_state_dict()), got a {type(app_state).__name__}"
        )
    for name, obj in app_state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidInputError(f"app_state key {name!r} must be a non-empty str without '/'")
        lacks = [
            m
            for m in ("state_dict", "load_state_dict")[: 2 if restoring else 1]
            if not callable(getattr(obj, m, None))
        ]
        if lacks:
            raise UnsupportedValueError(
                f"app_state[{name!r}] is a {type(obj).__name__} without {' or '.join(f'{m}()' for m in lacks)}: "
                "every app_state value must be stateful. Wrap plain values as ckstore.StateDict(...) "
                "(and RNG state as ckstore.RNGState())"
            )


def rng_last(app_state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``app_state``'s items with every :class:`RNGState` moved to the end (order otherwise kept)."""
    return sorted(app_state.items(), key=lambda kv: isinstance(kv[1], RNGState))
