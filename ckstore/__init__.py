"""ckstore: a content-addressed, versioned, deduplicating checkpoint store for PyTorch.

    store = ckstore.open("./ckpts", create=True)
    snap = store.take(app_state, run="sft", step=100)
    store.get("sft").restore(app_state)

The public names are imported lazily, so ``ckstore.objects`` and ``ckstore.index`` (which
never use torch) stay light when imported on their own. ``__all__`` is the public API, and
what ``dir(ckstore)`` lists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    DestinationExistsError,
    DistributedError,
    GuardError,
    GuardWarning,
    IndexCorruptionError,
    IndexDatabaseError,
    InvalidInputError,
    KeyNotFoundError,
    LeaseExpiredError,
    MetadataWarning,
    MismatchError,
    NonFiniteError,
    NonFiniteWarning,
    NoSpaceError,
    NotFoundError,
    ObjectNotFoundError,
    RankLostError,
    ReadOnlyStoreError,
    SchemaError,
    SnapshotNotFoundError,
    StaleStateError,
    StaleStateWarning,
    StorageError,
    UnsafePickleError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from .engine.knobs import STORE_DEFAULT, StoreDefault
    from .engine.stateful import RNGState, StateDict, Stateful
    from .engine.take.blocking import BlockingReport
    from .format.manifest import TensorEntry, ValueEntry
    from .interval import TakeInterval
    from .snapshot import PendingSnapshot, StoredSnapshot
    from .store import Store, clone, open
    from .torchsnapshot import Snapshot

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "BlockingReport": "engine.take.blocking",
    "TakeInterval": "interval",
    "TensorEntry": "format.manifest",
    "ValueEntry": "format.manifest",
    "PendingSnapshot": "snapshot",
    "Snapshot": "torchsnapshot",
    "StoredSnapshot": "snapshot",
    "RNGState": "engine.stateful",
    "Stateful": "engine.stateful",
    "StateDict": "engine.stateful",
    "Store": "store",
    "STORE_DEFAULT": "engine.knobs",
    "StoreDefault": "engine.knobs",
    "open": "store",
    "clone": "store",
}
_LAZY_MODULES = (
    "dcp",
    "interop",
)  # public submodules reachable as attributes after ``import ckstore``


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ckstore' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


__all__ = [
    "STORE_DEFAULT",
    "BlockingReport",
    "CkstoreError",
    "ConflictError",
    "CorruptionError",
    "DestinationExistsError",
    "DistributedError",
    "GuardError",
    "GuardWarning",
    "IndexCorruptionError",
    "IndexDatabaseError",
    "InvalidInputError",
    "KeyNotFoundError",
    "LeaseExpiredError",
    "MetadataWarning",
    "MismatchError",
    "NoSpaceError",
    "NonFiniteError",
    "NonFiniteWarning",
    "NotFoundError",
    "ObjectNotFoundError",
    "PendingSnapshot",
    "RNGState",
    "RankLostError",
    "ReadOnlyStoreError",
    "SchemaError",
    "Snapshot",
    "SnapshotNotFoundError",
    "StaleStateError",
    "StaleStateWarning",
    "StateDict",
    "Stateful",
    "StorageError",
    "Store",
    "StoreDefault",
    "StoredSnapshot",
    "TakeInterval",
    "TensorEntry",
    "UnsafePickleError",
    "UnsupportedValueError",
    "ValueEntry",
    "clone",
    "dcp",
    "errors",
    "interop",
    "open",
]
