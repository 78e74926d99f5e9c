"""Memory a restore's passes stage chunks in: the :class:`Arena` of verified chunks (the memory
budget) and the :class:`Pools` of host buffers for destinations that are not contiguous CPU
tensors (pinned for CUDA, so the copy to the device overlaps the next chunk's decoding)."""

from __future__ import annotations

import threading

import torch

from .. import devices
from ..devices import Copier, HostPool
from .jobs import Job, raw_bytes

POOL_BUFFERS_PER_THREAD = 2
"""Host buffers per thread for non-direct destinations: one being decoded into while the
previous one's copy to the device is still in flight (double buffering)."""


class Arena:
    """Staging memory for verified chunks: slots handed out first come, up to ``capacity`` bytes.

    Allocated once, on first use, no larger than what it is asked for in total; pinned when a
    copy from it goes to a CUDA device.
    """

    def __init__(self, capacity: int, want: int, copier: Copier | None = None) -> None:
        self.capacity = max(0, min(capacity, want))
        self._copier = copier or Copier()
        self._buf: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview | None:
        """A slot of ``n`` bytes (64-byte aligned), or None once the arena is full."""
        with self._lock:
            start = -(-self._used // 64) * 64
            if start + n > self.capacity:
                return None
            if self._buf is None:
                self._buf = self._copier.host_buffer(self.capacity)
            self._used = start + n
            return memoryview(self._buf.numpy()).cast("B")[start : start + n]  # type: ignore[arg-type]

    @property
    def used(self) -> int:
        return self._used


def arena_copier(jobs: list[Job]) -> Copier:
    """Pinned arena memory when a staged chunk will be copied to a CUDA device."""
    for j in jobs:
        if j.dst is not None and j.dst.device.type == "cuda":
            return devices.copier_for(j.dst)
    return Copier()


class Pools:
    """One host pool per destination device of the jobs that need one; waits for every copy
    on exit."""

    def __init__(self, threads: int, jobs: list[Job]) -> None:
        self._threads = threads
        self._size = max(
            (raw_bytes(j) for j in jobs if j.out is None and j.dst is not None), default=0
        )
        self._pools: dict[torch.device, HostPool] = {}
        self._lock = threading.Lock()

    @staticmethod
    def bytes_needed(threads: int, jobs: list[Job]) -> int:
        """Host memory the pools may take for these jobs (per destination device)."""
        sizes = [raw_bytes(j) for j in jobs if j.out is None and j.dst is not None]
        devs = {j.dst.device for j in jobs if j.out is None and j.dst is not None}
        return max(sizes, default=0) * POOL_BUFFERS_PER_THREAD * threads * len(devs)

    def pool(self, dst: torch.Tensor) -> HostPool:
        with self._lock:
            pool = self._pools.get(dst.device)
            if pool is None:
                pool = self._pools[dst.device] = HostPool(
                    devices.copier_for(dst), self._size, POOL_BUFFERS_PER_THREAD * self._threads
                )
            return pool

    def copier(self, dst: torch.Tensor) -> Copier:
        return self.pool(dst).copier

    def __enter__(self) -> Pools:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self._pools.values():
            pool.drain()
            pool.copier.finish()
