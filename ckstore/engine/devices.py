"""Copies between host staging buffers and device tensors, and a bounded pool of those buffers.

Takes and restores touch tensors on any device through one small interface, so the pipeline
logic (a bounded pool, copies overlapped with hashing, reads and writes) is the same code on
every device and is exercised on CPU by the tests:

* :class:`Copier` copies between a host buffer and a tensor and returns a :class:`Transfer`.
  The CPU copier copies at once; :class:`CudaCopier` allocates pinned host buffers and copies
  asynchronously on a side stream, each transfer completing when its CUDA event does.
* :class:`HostPool` hands out at most ``count`` host buffers of ``size`` bytes and takes each
  back with the transfer that still reads or writes it; a buffer is reused only once that
  transfer completed. Its :attr:`HostPool.nbytes` is what a memory budget counts (pinned
  memory included).

:func:`host_empty` makes the new tensors a read fills and hands to its caller: huge pages where
they are free, so filling them runs near memory speed.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Protocol

import torch

from ..objects.memory import HUGE_MIN_BYTES, huge_memory

DEVICE_TYPES = frozenset({"cuda"})
"""Device types reached through host buffers: a take stages their tensors chunk by chunk (not
copied whole at planning), a restore decodes into a host buffer and copies each chunk over."""


def host_empty(shape: Any, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new contiguous CPU tensor that one pass fills and the caller keeps (contents
    undefined): a read's new tensors. From :data:`~ckstore.objects.memory.HUGE_MIN_BYTES`
    on, in memory of its own backed by huge pages where they are free
    (:func:`~ckstore.objects.memory.huge_memory`: a 64 MiB tensor filled in 12 ms against 44
    ms in 4 KiB pages here); such a tensor cannot be resized past its size, as a tensor of
    ``torch.load(mmap=True)`` or ``torch.from_numpy`` cannot."""
    n = math.prod(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    nbytes = n * dtype.itemsize
    got = huge_memory(nbytes) if nbytes >= HUGE_MIN_BYTES else None
    if got is None:
        return torch.empty(shape, dtype=dtype)
    mem, start = got
    flat = torch.frombuffer(mem, dtype=torch.uint8, count=nbytes, offset=start)
    return flat.view(dtype).reshape(shape)


class Transfer(Protocol):
    """An asynchronous copy in flight."""

    def done(self) -> bool:
        """True once the copy completed."""

    def wait(self) -> None:
        """Block until the copy completed."""


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: Transfer = _Done()
"""A transfer that already completed (what synchronous copies return)."""


class Copier:
    """Copies between host staging buffers and tensors of one device kind (CPU: at once)."""

    pinned = False
    """Whether :meth:`host_buffer` returns page-locked memory."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A new uint8 host tensor of ``nbytes`` (contents undefined)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Start copying ``src`` into ``dst`` (same shape and dtype; one of them may be a
        host buffer); the returned transfer says when both may be reused."""
        with torch.no_grad():
            dst.copy_(src)
        return DONE

    def finish(self) -> None:
        """Wait for every copy started, and make the results visible to the caller's work."""


class CudaCopier(Copier):
    """Pinned host buffers; copies on a side stream, overlapped with the caller's host work.

    The side stream first waits for the device's current stream (a take sees every kernel the
    caller queued; a restore does not race the kernels that built the destination), and
    :meth:`finish` makes the current stream wait for the side stream.
    """

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        with self._lock, torch.no_grad():
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.stream)
        return _CudaTransfer(event)

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()


class _CudaTransfer:
    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


def copier_for(t: torch.Tensor) -> Copier:
    """The copier for ``t``'s device: CUDA tensors get a :class:`CudaCopier`, any other a CPU one."""
    if t.device.type == "cuda":
        return CudaCopier(t.device)
    return Copier()


class HostPool:
    """At most ``count`` host buffers of ``size`` bytes each, recycled as their transfers end.

    :meth:`acquire` returns a free buffer, else allocates one while fewer than ``count``
    exist, else waits for the oldest buffer handed back whose transfer is still running.
    Safe to use from several threads.
    """

    def __init__(self, copier: Copier, size: int, count: int) -> None:
        self.copier = copier
        self.size = max(1, size)
        self.count = max(1, count)
        self._free: deque[torch.Tensor] = deque()
        self._busy: deque[tuple[torch.Tensor, Transfer]] = deque()
        self._made = 0
        self._cond = threading.Condition()
        self.peak_in_use = 0
        self._in_use = 0

    @property
    def nbytes(self) -> int:
        """The most host memory this pool may hold (what a budget counts)."""
        return self.size * self.count

    def acquire(self) -> torch.Tensor:
        """A buffer of ``size`` bytes that no transfer uses any more."""
        with self._cond:
            while True:
                buf = self._take_ready()
                if buf is not None:
                    break
                if self._made < self.count:
                    self._made += 1
                    buf = self.copier.host_buffer(self.size)
                    break
                if self._busy:
                    buf, transfer = self._busy.popleft()
                    self._cond.release()
                    try:
                        transfer.wait()
                    finally:
                        self._cond.acquire()
                    break
                self._cond.wait()
            self._in_use += 1
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            return buf

    def _take_ready(self) -> torch.Tensor | None:
        if self._free:
            return self._free.pop()
        if self._busy and self._busy[0][1].done():
            return self._busy.popleft()[0]
        return None

    def release(self, buf: torch.Tensor, transfer: Transfer = DONE) -> None:
        """Hand ``buf`` back; it is reused once ``transfer`` (still using it) completed."""
        with self._cond:
            self._in_use -= 1
            if transfer.done():
                self._free.append(buf)
            else:
                self._busy.append((buf, transfer))
            self._cond.notify()

    def drain(self) -> None:
        """Wait for every transfer still using a buffer of this pool."""
        with self._cond:
            busy, self._busy = list(self._busy), deque()
        for buf, transfer in busy:
            transfer.wait()
            with self._cond:
                self._free.append(buf)
                self._cond.notify()
