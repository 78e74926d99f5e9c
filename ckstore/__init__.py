"""ckstore: a content-addressed, versioned, deduplicating checkpoint store for PyTorch.

    store = ckstore.open("./ckpts")
    snap = store.take(app_state, run="sft", step=100)
    store.get("sft").restore(app_state)

The public names are imported lazily, so ``ckstore.objects`` and ``ckstore.index`` (which
never use torch) stay light when imported on their own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    KeyNotFoundError,
    LeaseExpiredError,
    MismatchError,
    NotFoundError,
    SchemaError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from .manifest import TensorEntry, ValueEntry
    from .snapshot import PendingSnapshot, Snapshot
    from .stateful import RNGState, StateDict, Stateful
    from .store import Store, open

__version__ = "0.1.0"

_LAZY = {
    "TensorEntry": "manifest",
    "ValueEntry": "manifest",
    "PendingSnapshot": "snapshot",
    "Snapshot": "snapshot",
    "RNGState": "stateful",
    "Stateful": "stateful",
    "StateDict": "stateful",
    "Store": "store",
    "open": "store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckstore' has no attribute {name!r}")


__all__ = [
    "CkstoreError",
    "ConflictError",
    "CorruptionError",
    "InvalidInputError",
    "KeyNotFoundError",
    "LeaseExpiredError",
    "MismatchError",
    "NotFoundError",
    "PendingSnapshot",
    "RNGState",
    "SchemaError",
    "Snapshot",
    "SnapshotNotFoundError",
    "StateDict",
    "Stateful",
    "Store",
    "TensorEntry",
    "UnsupportedValueError",
    "ValueEntry",
    "errors",
    "open",
]
