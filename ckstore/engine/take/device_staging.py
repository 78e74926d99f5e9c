"""Staging chunks of device tensors (GPU) into host memory for a take, through bounded pools.

A take hashes, looks up and encodes chunks batch by batch (``engine/take/single.py``). For a chunk of a
device tensor, :func:`stage` takes a buffer from its device's :class:`~.devices.HostPool`
(pinned for CUDA) and starts the device-to-host copy on the copier's side stream; hashing waits
for each chunk's own copy (``Chunk.ready``), so copies overlap the hashing of the chunks before
them and the pack writes in flight. Once the batch's missing chunks are encoded into packs,
:meth:`DeviceStager.release` hands the buffers back. Pinned memory is bounded by
``DEVICE_STAGING_BYTES`` per device, whatever the state's size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import devices
from ..devices import Copier, HostPool
from .packing import Chunk

DEVICE_STAGING_BYTES = 128 << 20
"""Host (pinned) memory per device a take stages device chunks through; device chunks are
hashed in batches of at most this many bytes."""


def is_device_tensor(t: Any) -> bool:
    """Whether a take stages ``t`` through host pools (a plain strided CUDA tensor), rather
    than copying it to the host whole."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type in devices.DEVICE_TYPES
        and t.layout == torch.strided
        and not t.is_quantized
    )


class DeviceStager:
    """Host pools, one per device, that a take's device chunks are copied into."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = max(1, chunk_bytes)
        self._pools: dict[torch.device, HostPool] = {}
        self._held: list[tuple[HostPool, torch.Tensor, Any]] = []

    @property
    def batch_bytes(self) -> int:
        """The most bytes of device chunks one batch may hold (all of it staged at once)."""
        return self._chunk_bytes * self.batch_chunks

    @property
    def batch_chunks(self) -> int:
        """The most device chunks one batch may hold (one pool buffer each)."""
        return self._count()

    def _count(self) -> int:
        return max(2, math.ceil(DEVICE_STAGING_BYTES / self._chunk_bytes))

    def _pool(self, t: torch.Tensor) -> HostPool:
        pool = self._pools.get(t.device)
        if pool is None:
            copier: Copier = devices.copier_for(t)
            pool = self._pools[t.device] = HostPool(copier, self._chunk_bytes, self._count())
        return pool

    def stage(self, batch: list[Chunk]) -> None:
        """Start copying every device chunk of ``batch`` into a host buffer (asynchronously)."""
        for c in batch:
            if c.source is None:
                continue
            pool = self._pool(c.source)
            buf = pool.acquire()
            host = buf[: c.nbytes]
            c.transfer = pool.copier.copy(host, c.source)
            c.view = memoryview(host.numpy())  # type: ignore[arg-type]
            self._held.append((pool, buf, c.transfer))

    def release(self) -> None:
        """Hand back every buffer staged so far (their chunks are hashed and encoded)."""
        held, self._held = self._held, []
        for pool, buf, transfer in held:
            pool.release(buf, transfer)

    def close(self) -> None:
        self.release()
        for pool in self._pools.values():
            pool.drain()
            pool.copier.finish()

    @property
    def pools(self) -> dict[torch.device, HostPool]:
        return self._pools
