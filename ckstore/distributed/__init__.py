"""Distributed snapshots: every rank calls the same ``take`` / ``restore``.

``store.take`` and ``snap.restore`` switch to these paths by themselves when
``torch.distributed`` is initialised. Ranks exchange plans and results as JSON (never pickle)
over a dedicated gloo group whose timeout (``CKSTORE_DIST_TIMEOUT``, default 600 s) bounds how
long a dead or stuck rank can hold up the others.

Public modules: :mod:`~ckstore.distributed.take` (the distributed take, now or in the
background), :mod:`~ckstore.distributed.restore`, :mod:`~ckstore.distributed.comm` (the
communicator and :func:`~ckstore.distributed.comm.phase`, the one way a phase of a collective
operation reports failures). This module itself stays importable without torch.
"""

from __future__ import annotations


def is_distributed() -> bool:
    """True when torch.distributed is initialised in this process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized())
