"""Staging for async takes: a private copy of every tensor, containers rebuilt alike, and the
arena single-process async takes cut their copies from."""

from __future__ import annotations

import io
import mmap
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ...errors import InvalidInputError
from ...format.boxes import is_dtensor
from ...format.limits import MAX_DEPTH
from ...format.tensors import bits_view, check_tensor
from ...format.tree import is_array, join
from ...objects.memory import address_of, private_memory
from ..repository import Repository

ALIGN = 64
"""Staged copies start on 64-byte boundaries (cache lines; what vectorised code wants)."""


def arena_bytes(value: Any) -> int:
    """Bytes a copy of ``value`` (a tensor or an array) takes in a :class:`StagingArena` (0:
    it is copied on its own, as a DTensor or a tensor of an unusual layout is)."""
    if isinstance(value, torch.Tensor) and not _plain(value):
        return 0
    if isinstance(value, np.ndarray) and value.dtype.hasobject:
        return 0  # no bytes to copy: planning refuses it, naming its key
    n = (
        value.numel() * value.element_size()
        if isinstance(value, torch.Tensor)
        else int(value.nbytes)
    )
    return -(-n // ALIGN) * ALIGN


def _plain(t: torch.Tensor) -> bool:
    """A dense, strided, non-quantized tensor that is not a DTensor."""
    return t.layout == torch.strided and not t.is_quantized and not is_dtensor(t)


class StagingArena:
    """One block of anonymous memory that staged copies are cut from, reusable take after take.

    An async take blocks for as long as copying the state takes, and copying into fresh memory
    costs a page fault per page (the kernel zeroes each): about three times a copy into memory
    already touched (65 ms against 22 ms for 270 MiB here). A repository keeps the arena of its
    last async take (:meth:`reset` and reused by the next one: a training loop's takes copy at
    memory speed from the second on). Private (a child forked meanwhile gets its own pages, see
    ``private_memory``); it goes back to the system once dropped and the last tensor cut from it
    is gone. Huge pages are not asked for (``objects.memory.huge_memory``): on this
    project's test machines, virtual machines whose balloon reports free 2 MiB blocks to the
    host, a new arena's huge pages each fault in from the host, and a first copy of 270 MiB
    took 137-495 ms with them against 117-149 ms without (an earlier measurement saw a 0.3 s
    stall). Where free memory is not handed back to a host they fill about three times
    faster; left for a measurement on such a machine.
    """

    def __init__(self, nbytes: int, pinned: bool = False, shared: bool = False) -> None:
        """``pinned``: page-locked memory (CUDA's host allocator), for states on a GPU: copies
        from the device run at the bus's speed and are issued all at once (:meth:`finish`
        waits for them), where pageable memory is copied through a bounce buffer, one tensor
        after another. ``shared``: pageable memory in a memfd (:attr:`fd`) that a helper
        process maps to store the copies (``engine/take/offload.py``; Linux)."""
        self.pinned = pinned
        self.shared = shared and not pinned
        self.fd: int | None = None
        self.pid = os.getpid()
        self._pinned: torch.Tensor | None = None
        self._mem: Any = None
        if pinned:
            with torch.inference_mode(False):  # copied into outside it too (see place)
                self._pinned = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        elif self.shared:
            self.fd = os.memfd_create("ckstore-staging")
            os.ftruncate(self.fd, max(nbytes, 1))
            self._mem = mmap.mmap(self.fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
        else:
            self._mem = private_memory(max(nbytes, 1))
        self._base = address_of(self._mem) if self._mem is not None else 0
        self.size = nbytes
        self._at = 0
        self._streams: list[Any] = []  # CUDA streams with copies into this arena in flight
        # keyed by (offset, dtype, *shape): a flat tuple of ints and a dtype, which Python's
        # collector stops tracking (a torch.Size in it would be promoted, take after take)
        self._rooms: dict[tuple[Any, ...], torch.Tensor] = {}
        self._placed: list[tuple[Any, ...]] = []  # since the last reset

    def offset_of(self, value: Any) -> int | None:
        """Where in a pageable arena a tensor or array cut from it starts (None: not cut from
        this arena)."""
        if self._mem is None:
            return None
        if isinstance(value, torch.Tensor):
            at = value.data_ptr() - self._base if value.device.type == "cpu" else -1
        elif isinstance(value, np.ndarray):
            at = int(value.__array_interface__["data"][0]) - self._base
        else:
            return None
        n = value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
        return at if 0 <= at and at + n <= self.size else None

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def reset(self) -> None:
        """Make the whole arena free again (every tensor cut from it is no longer used)."""
        self._at = 0
        # the rooms the last take placed are kept for the next (a state of other shapes
        # must not grow the cache); a reset with nothing placed since keeps them all
        if self._placed:
            self._rooms = {where: self._rooms[where] for where in self._placed}
            self._placed = []

    def finish(self) -> None:
        """Wait for the copies from devices issued into this arena (a pinned arena's copies
        are asynchronous); after it returns every copy holds the value it was made from."""
        streams, self._streams = self._streams, []
        for stream in streams:
            stream.synchronize()

    def place(self, value: Any) -> Any:
        """Room for a copy of ``value`` (a CPU tensor or a numpy array, ``arena_bytes`` > 0) in
        a pageable arena, not filled: a tensor or array of its dtype and shape that
        :func:`fill` copies ``value`` into later (a take plans its chunks on the copies
        meanwhile: planning reads no tensor's bytes but an inline one's).

        Raises:
            InvalidInputError: the arena has no room left, or it is pinned (copies from a
                device are issued by :meth:`copy`, already asynchronous).
        """
        if self._mem is None:
            raise InvalidInputError("a pinned staging arena copies at once: use copy()")
        at = self._room(arena_bytes(value))
        if isinstance(value, np.ndarray):
            return np.frombuffer(self._mem, dtype=value.dtype, count=value.size, offset=at).reshape(
                value.shape
            )
        # a training loop places the same tensors at the same offsets take after take: the
        # room made for the last take is reused (it only ever holds the copy made into it)
        where = (at, value.dtype, *value.shape)
        room = self._rooms.get(where)
        if room is None:
            # a normal tensor even under torch.inference_mode() (an evaluation's take): a
            # later take outside it copies into the same room, and filler threads never run
            # in inference mode (an inference tensor refuses writes outside it)
            with torch.inference_mode(False):
                room = torch.frombuffer(
                    self._mem, dtype=value.dtype, count=value.numel(), offset=at
                ).view(value.shape)
            self._rooms[where] = room
        self._placed.append(where)
        return room

    def _room(self, n: int) -> int:
        if self._at + n > self.size:
            raise InvalidInputError(f"staging arena of {self.size} bytes has no room for {n} more")
        at, self._at = self._at, self._at + n
        return at

    def copy(self, value: Any) -> Any:
        """A copy of ``value`` (a tensor, on any device, or a numpy array) in the arena, on the
        CPU, contiguous, with its dtype and shape.

        Raises:
            InvalidInputError: the arena has no room left (it was sized for other values).

        In a pinned arena a copy from a GPU may still be in flight: :meth:`finish` waits.
        """
        n = arena_bytes(value)
        if n == 0:
            return (
                value.copy()
                if isinstance(value, np.ndarray)
                else value.detach().to("cpu", copy=True)
            )
        if self._mem is not None:
            out = self.place(value)
            fill([(out, value)])
            return out
        at = self._room(n)
        assert self._pinned is not None
        size = (
            value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
        )
        block = self._pinned[at : at + size]
        if isinstance(value, np.ndarray):
            out = block.numpy().view(value.dtype).reshape(value.shape)
            np.copyto(out, value)
            return out
        dst = block.view(value.dtype).view(value.shape)
        src = value.detach()
        if src.is_cuda:
            stream = torch.cuda.current_stream(src.device)
            dst.copy_(src, non_blocking=True)  # ordered after the kernels that wrote it
            if stream not in self._streams:
                self._streams.append(stream)
        else:
            dst.copy_(src)
        return dst

    def touch(self) -> None:
        """Write every page of a pageable arena once, so the copies of the next take that uses
        it run at memory speed (the page faults are taken here instead; what
        ``Store.prepare_staging`` runs behind training)."""
        if self._mem is not None and self.size:
            pages = np.frombuffer(self._mem, dtype=np.uint8, count=self.size)
            pages[:: mmap.PAGESIZE] = 0


def fill(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each ``(destination, value)`` that :meth:`StagingArena.place` made room for (a
    numpy array or a CPU tensor into its place); releases the GIL while it copies."""
    # no detached copy of each source nor a pair per tensor: inference mode keeps the
    # destinations out of autograd, backward and forward (no_grad leaves forward AD on, and
    # _foreach_copy_ refuses a dual source), and a take of many tensors leaves fewer objects
    # for Python's collector
    dsts = [bits_view(d) for d, v in pairs if isinstance(v, torch.Tensor)]
    if dsts:  # one call: the loop over the tensors runs in C++, without the GIL
        srcs = [bits_view(v) for _, v in pairs if isinstance(v, torch.Tensor)]
        with torch.inference_mode():
            torch._foreach_copy_(dsts, srcs)
    for dst, value in pairs:
        if isinstance(value, np.ndarray):
            np.copyto(dst, value)


def stage(obj: Any, key: str = "", arena: StagingArena | None = None) -> Any:
    """Copy tensors/arrays (to CPU), ``bytearray`` and ``io.BytesIO`` values, and rebuild
    containers; immutable scalars are shared.

    After this returns, nothing the caller does to its tensors, dicts or lists changes the copy.
    Tensors ckstore cannot store are refused before anything is copied (``key`` names where
    ``obj`` sits, for the message); containers nested past ``MAX_DEPTH`` are refused too.

    With ``arena`` (sized by :func:`arena_size`), the tensors and arrays it holds
    (``arena_bytes`` > 0; those on a GPU only into a pinned one) are copied into it, the others
    on their own; call ``arena.finish()`` before reading the copies.

    Raises:
        UnsupportedValueError: a meta, nested or storage-less tensor (the key is named).
        InvalidInputError: containers nested too deep.
    """
    return _stage(obj, key, 0, arena)


def _stage(obj: Any, key: str, depth: int, arena: StagingArena | None) -> Any:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined] # a DTensor: its shard is staged
        check_tensor(local, key)
        if _in_arena(obj, arena):
            return arena.copy(obj)  # type: ignore[union-attr]
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, np.ndarray) and is_array(obj):  # a masked array is refused by planning
        return arena.copy(obj) if _in_arena(obj, arena) else obj.copy()  # type: ignore[union-attr]
    if isinstance(obj, (dict, list, tuple)) and not isinstance(obj, torch.Size):
        if depth > MAX_DEPTH:  # depth 0 is the app_state mapping around the state dicts
            raise InvalidInputError(
                f"key {key!r}: containers nested deeper than {MAX_DEPTH} levels"
            )
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _stage(v, join(key, str(k)), depth + 1, arena)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = _stage(meta, key, depth + 1, arena)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_stage(v, join(key, str(i)), depth + 1, arena) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_stage(v, join(key, str(i)), depth + 1, arena) for i, v in enumerate(obj))
    if isinstance(obj, bytearray):  # the plain values that can change in place
        return bytearray(obj)
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return obj


def _in_arena(value: Any, arena: StagingArena | None) -> bool:
    """Whether :func:`stage` copies ``value`` into ``arena``."""
    if arena is None or not arena_bytes(value):
        return False
    return arena.pinned or not (isinstance(value, torch.Tensor) and value.device.type != "cpu")


def arena_size(obj: Any, key: str = "", depth: int = 0) -> tuple[int, bool]:
    """The bytes of an arena for :func:`stage`'s copies of ``obj`` (its tensors and arrays,
    ``arena_bytes`` each) and whether one of them is on a GPU (the arena must be pinned).

    Tensors ckstore cannot store are refused here, before any memory is allocated for them (a
    meta tensor's declared size); containers past ``MAX_DEPTH`` are not looked into
    (:func:`stage` refuses them).

    Raises:
        UnsupportedValueError: as :func:`stage`, naming the key.
    """
    if isinstance(obj, torch.Tensor):
        check_tensor(obj.to_local() if is_dtensor(obj) else obj, key)  # type: ignore[attr-defined]
        return arena_bytes(obj), obj.device.type == "cuda" and arena_bytes(obj) > 0
    if isinstance(obj, np.ndarray):
        return arena_bytes(obj), False
    if depth > MAX_DEPTH or isinstance(obj, torch.Size):
        return 0, False
    if isinstance(obj, dict):
        items = [(join(key, str(k)), v) for k, v in obj.items()]
        meta = getattr(obj, "_metadata", None)
        items += [(key, meta)] if meta is not None else []
    elif isinstance(obj, (list, tuple)):
        items = [(join(key, str(i)), v) for i, v in enumerate(obj)]
    else:
        return 0, False
    total, on_gpu = 0, False
    for at, item in items:
        n, gpu = arena_size(item, at, depth + 1)
        total, on_gpu = total + n, on_gpu or gpu
    return total, on_gpu


def arena_for(
    repo: Repository, nbytes: int, pinned: bool = False, shared: bool = False
) -> StagingArena:
    """An arena of at least ``nbytes`` for an async take's copies (``pinned``: page-locked,
    for a state on a GPU; ``shared``: one a helper process can map): the one the repository's
    last async take gave back when it fits (its pages are touched already: copies run at memory
    speed), else a new one. A shared arena is reused by the process that made it only (a child
    forked meanwhile would write into its parent's memory). Give it back with :func:`give_back`
    once the take is done."""
    arena = repo.spare_staging.take()
    if (
        arena is not None
        and arena.pinned == pinned
        and arena.shared == (shared and not pinned)
        and (not arena.shared or arena.pid == os.getpid())
        and nbytes <= arena.size <= 2 * nbytes + (64 << 20)
    ):
        arena.reset()
        return arena
    return StagingArena(nbytes, pinned, shared)


def give_back(repo: Repository, arena: StagingArena) -> None:
    """Keep ``arena`` (no tensor cut from it is used any more) for the repository's next async
    take; dropped when the repository closes."""
    repo.spare_staging.offer(arena, lambda kept: kept.size < arena.size)
