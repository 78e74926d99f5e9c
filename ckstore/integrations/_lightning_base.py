"""Which Lightning the plugin belongs to: every one installed.

Lightning ships twice: the unified ``lightning`` package (``lightning.pytorch``, with its own
``lightning.fabric``) and ``pytorch_lightning`` (with ``lightning_fabric``). Each Trainer
accepts only plugins that are instances of its own ``CheckpointIO`` class, and
``pip install 'ckstore[lightning]' lightning`` installs both. So the plugin derives from the
``TorchCheckpointIO`` of the first package found (the unified one first) and is registered as a
virtual subclass of the other's (:func:`register_everywhere`): ``Trainer(plugins=[io])`` of
either accepts it, and so do their ``AsyncCheckpointIO`` wrappers. The callbacks derive from
the ``Callback`` of the Trainer package that goes with that ``TorchCheckpointIO`` (a Trainer
calls its callbacks' hooks by name, whichever package they come from).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_PACKAGES = (
    "lightning.fabric.plugins.io.torch_io",  # pip install lightning
    "lightning_fabric.plugins.io.torch_io",  # pip install pytorch-lightning
)


def _installed() -> list[Any]:
    """The ``TorchCheckpointIO`` classes of the Lightning packages installed, unified first."""
    found = []
    for module in _PACKAGES:
        if importlib.util.find_spec(module.split(".", 1)[0]) is None:
            continue
        try:
            found.append(importlib.import_module(module).TorchCheckpointIO)
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "ckstore.integrations.lightning needs Lightning: pip install 'ckstore[lightning]' "
            "(pytorch-lightning) or pip install lightning"
        )
    return found


_CLASSES = _installed()
TorchCheckpointIO: Any = _CLASSES[0]
"""The base of the plugin: the first installed package's ``TorchCheckpointIO``."""


def register_everywhere(cls: type) -> None:
    """Make ``cls`` (a subclass of :data:`TorchCheckpointIO`) a ``TorchCheckpointIO``, and so a
    ``CheckpointIO``, of every other Lightning package installed."""
    for other in _CLASSES[1:]:
        if not issubclass(cls, other):
            other.register(cls)


def _callback() -> Any:
    """The ``Callback`` class of the Trainer package that goes with :data:`TorchCheckpointIO`
    (the other package's where only that one has a Trainer; ``object`` where none has)."""
    unified = TorchCheckpointIO.__module__.startswith("lightning.")
    trainers = ("lightning.pytorch", "pytorch_lightning")
    for module in trainers if unified else trainers[::-1]:
        if importlib.util.find_spec(module.split(".", 1)[0]) is None:
            continue
        try:
            return importlib.import_module(module).Callback
        except ImportError:
            continue
    return object  # Fabric alone: no Trainer to call a callback (the plugin still works)


Callback: Any = _callback()
"""The base of the callbacks (:class:`~ckstore.integrations.lightning.CkstoreInterval`)."""
