"""ckstore: a content-addressed, versioned, deduplicating checkpoint store for PyTorch.

    store = ckstore.open("./ckpts", create=True)
    snap = store.take(app_state, run="sft", step=100)
    store.get("sft").restore(app_state)

The public names are imported lazily, so ``ckstore.objects`` and ``ckstore.index`` (which
never use torch) stay light when imported on their own. ``__all__`` is the public API, and
what ``dir(ckstore)`` lists.

``import ckstore`` also lets ``dcp.save`` / ``dcp.load`` pick ckstore for a ``ckstore://``
checkpoint id (:mod:`ckstore.dcp.url`): once ``torch.distributed.checkpoint`` is imported
(now, or whenever it is), :mod:`ckstore.dcp` is imported with it and teaches DCP those ids.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    AppNotFoundError,
    CheckpointNotFoundError,
    CkstoreError,
    CommitUnknownError,
    ConflictError,
    CorruptionError,
    DestinationExistsError,
    DistributedError,
    GuardError,
    GuardWarning,
    HealedWarning,
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
    ReplicaDivergenceError,
    ReplicaDivergenceWarning,
    ResaveWarning,
    SchemaError,
    SnapshotNotFoundError,
    StaleStateError,
    StaleStateWarning,
    StorageError,
    UnsafePickleError,
    UnsupportedValueError,
    WriteBackWarning,
)

if TYPE_CHECKING:
    from ._open import clone, open
    from .engine.knobs import STORE_DEFAULT, StoreDefault
    from .engine.stateful import RNGState, StateDict, Stateful
    from .engine.take.blocking import BlockingReport
    from .format.manifest import TensorEntry, ValueEntry
    from .interval import TakeInterval
    from .pending import PendingSnapshot
    from .snapshot import StoredSnapshot
    from .store import Store
    from .torchsnapshot import Snapshot

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "BlockingReport": "engine.take.blocking",
    "TakeInterval": "interval",
    "TensorEntry": "format.manifest",
    "ValueEntry": "format.manifest",
    "PendingSnapshot": "pending",
    "Snapshot": "torchsnapshot",
    "StoredSnapshot": "snapshot",
    "RNGState": "engine.stateful",
    "Stateful": "engine.stateful",
    "StateDict": "engine.stateful",
    "Store": "store",
    "STORE_DEFAULT": "engine.knobs",
    "StoreDefault": "engine.knobs",
    "open": "_open",
    "clone": "_open",
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
    "AppNotFoundError",
    "BlockingReport",
    "CheckpointNotFoundError",
    "CkstoreError",
    "CommitUnknownError",
    "ConflictError",
    "CorruptionError",
    "DestinationExistsError",
    "DistributedError",
    "GuardError",
    "GuardWarning",
    "HealedWarning",
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
    "ReplicaDivergenceError",
    "ReplicaDivergenceWarning",
    "ResaveWarning",
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
    "WriteBackWarning",
    "clone",
    "dcp",
    "errors",
    "interop",
    "open",
]


_DCP = "torch.distributed.checkpoint"


class _ArmDcp(importlib.abc.MetaPathFinder):
    """Imports :mod:`ckstore.dcp` right after ``torch.distributed.checkpoint`` finishes importing
    (its ``ckstore://`` ids then work without importing ``ckstore.dcp`` by hand); then steps
    aside. Finds nothing itself: the module is loaded by the finder that would load it anyway."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DCP:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _import_dcp()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _import_dcp() -> None:
    """Import :mod:`ckstore.dcp` (which teaches DCP the ``ckstore://`` ids); a failure is
    logged, never raised: it must not break the import of torch's DCP or of ckstore."""
    try:
        importlib.import_module(".dcp", __name__)
    except Exception as exc:  # noqa: BLE001 - only the ckstore:// ids are lost
        import logging

        logging.getLogger("ckstore").warning(
            "ckstore: dcp.save/load will not know ckstore:// checkpoint ids (%s: %s); "
            "import ckstore.dcp to see why",
            type(exc).__name__,
            exc,
        )


def _arm_dcp() -> None:
    if _DCP in sys.modules:
        _import_dcp()
    elif not any(isinstance(f, _ArmDcp) for f in sys.meta_path):
        sys.meta_path.insert(0, _ArmDcp())


_arm_dcp()
