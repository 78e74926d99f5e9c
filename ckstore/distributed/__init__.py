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

import os

from ..errors import InvalidInputError

REPLICATED_READS = ("once", "broadcast", "each")
"""How a distributed restore reads a whole tensor every rank needs (``replicated_read``)."""


def is_distributed() -> bool:
    """True when torch.distributed is initialised in this process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized())


def replicated_mode(value: str | None) -> str:
    """The read mode: the argument, else ``CKSTORE_REPLICATED_READ``, else "once" (here, not
    in ``restore``: a single-process restore checks its argument without importing the
    distributed path).

    Raises:
        InvalidInputError: not one of :data:`REPLICATED_READS`.
    """
    mode = value if value is not None else os.environ.get("CKSTORE_REPLICATED_READ", "once")
    if mode not in REPLICATED_READS:
        raise InvalidInputError(
            f"replicated_read must be one of {list(REPLICATED_READS)}, got {mode!r}"
        )
    return mode
