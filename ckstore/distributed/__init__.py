"""Distributed snapshots: every rank calls the same ``take`` / ``restore``.

``store.take`` and ``snap.restore`` switch to these paths by themselves when
``torch.distributed`` is initialised. Ranks exchange plans and results as JSON (never pickle)
over a dedicated gloo group whose timeout (``CKSTORE_DIST_TIMEOUT``, default 600 s) bounds how
long a dead or stuck rank can hold up the others.
"""

from __future__ import annotations

from typing import Any


def is_distributed() -> bool:
    """True when torch.distributed is initialised in this process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized())


def __getattr__(name: str) -> Any:
    if name in ("take", "restore"):
        from . import _restore, _take

        return {"take": _take.take, "restore": _restore.restore}[name]
    raise AttributeError(name)
