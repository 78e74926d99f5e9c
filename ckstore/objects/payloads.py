"""Where a chunk reader's payloads come from: views of mapped packs, or this thread's recycled
buffers; and the views one read kept, for the next (``chunk_reader``)."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

from ckstore.errors import CorruptionError
from ckstore.objects.backend import Backend
from ckstore.objects.codecs import MAX_RAW_LENGTH, check_out
from ckstore.objects.location import ChunkLocation
from ckstore.objects.memory import private_memory
from ckstore.objects.packs import pack_name

Kept = dict[str, memoryview]
"""The payload views of a chunk's chain by chunk id, kept by a verifying read (``keep``)."""

_local = threading.local()


def scratch(kind: str, n: int) -> mmap.mmap:
    """This thread's recycled scratch buffer ``kind`` of at least ``n`` bytes."""
    bufs = _local.__dict__.setdefault("scratch", {})
    buf: mmap.mmap | None = bufs.get(kind)
    if buf is None or len(buf) < n:
        buf = bufs[kind] = private_memory(max(n, 1 << 20))
    return buf


def check_sizes(loc: ChunkLocation, url: str) -> None:
    """Refuse impossible lengths before allocating anything for them.

    Raises:
        CorruptionError: a raw length over ``MAX_RAW_LENGTH``, or a stored one far beyond it.
    """
    if not (
        0 <= loc.raw_length <= MAX_RAW_LENGTH and 0 <= loc.length <= MAX_RAW_LENGTH + (1 << 12)
    ):
        raise CorruptionError(
            f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {url}) has "
            f"impossible lengths (stored {loc.length}, raw {loc.raw_length}; at most {MAX_RAW_LENGTH})"
        )


class Payloads:
    """Where one read gets its payloads: a view in ``kept`` (from an earlier read), else read
    from ``backend``: a view of the mapped pack where it maps (``Backend.mapped_views``),
    else into this thread's recycled buffer ``slot`` (valid until the thread's next read into
    it). With ``keep``, the mapped views it reads are put there."""

    def __init__(self, backend: Backend, kept: Kept | None = None, keep: Kept | None = None):
        self._backend, self._kept, self._keep = backend, kept, keep
        self.maps = backend.mapped_views

    def get(self, loc: ChunkLocation, slot: str = "payload") -> memoryview:
        """The stored payload of ``loc`` (this chunk only, not its chain).

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: impossible lengths, or the pack ends before the payload.
        """
        if self._kept is not None and loc.chunk_id in self._kept:
            return self._kept[loc.chunk_id]
        check_sizes(loc, self._backend.url)
        name = pack_name(loc.pack_id)
        if self.maps:
            view = self._backend.view(name, loc.offset, loc.length)
            if self._keep is not None:
                self._keep[loc.chunk_id] = view
            return view
        buf: mmap.mmap | None = getattr(_local, slot, None)
        if buf is None or len(buf) < loc.length:
            buf = private_memory(max(loc.length, 1 << 20))  # goes back with the thread
            setattr(_local, slot, buf)
        view = memoryview(buf)[: loc.length]
        self._backend.get_into(name, loc.offset, view)
        return view

    def read_into(
        self,
        loc: ChunkLocation,
        out: memoryview,
        each: Callable[[memoryview], object] | None = None,
    ) -> memoryview:
        """Read a raw chunk's payload straight into ``out`` (its decoded bytes, no copy
        beyond the read); the flat byte view of ``out`` it filled. With ``each``, every piece
        of it is passed to ``each`` once read, in order (``Backend.get_into_each``: a check of
        the bytes while they are in the CPU's cache).

        Raises:
            InvalidInputError: ``out`` is read-only or holds another number of bytes.
            CorruptionError: the stored length is not the raw length, or the pack ends early.
        """
        check_sizes(loc, self._backend.url)
        target = check_out(out, loc.raw_length)  # the caller's mistake: InvalidInputError
        assert target is not None
        if loc.length != loc.raw_length:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                f"cannot be decoded: raw chunk has {loc.length} bytes, expected {loc.raw_length}"
            )
        if each is None:
            self._backend.get_into(pack_name(loc.pack_id), loc.offset, target)
        else:
            self._backend.get_into_each(pack_name(loc.pack_id), loc.offset, target, each)
        return target
