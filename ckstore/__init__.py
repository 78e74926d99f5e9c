"""ckstore: a content-addressed, versioned, deduplicating checkpoint store for PyTorch.

    store = ckstore.open("./ckpts")
    snap = store.take(app_state, run="sft", step=100)
    store.get("sft").restore(app_state)
"""

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
from .manifest import TensorEntry, ValueEntry
from .snapshot import PendingSnapshot, Snapshot
from .stateful import RNGState, Stateful, StateDict
from .store import Store, open

__version__ = "0.1.0"

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
