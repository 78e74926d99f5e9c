"""What a codec is: one way of storing a chunk's raw bytes as a payload, and the limits every
decoder holds to.

A chunk's id is the BLAKE3 of its raw bytes whatever its codec: a codec only changes how the
chunk is stored. Each codec is a :class:`Codec` in a module of its own in this package, and one
instance of it is registered by name in :mod:`ckstore.objects.codecs.registry`. Which codec a
chunk gets is decided by the writer (:func:`ckstore.objects.codecs.encode` for a whole chunk,
:func:`ckstore.objects.delta.encode_delta` for a delta), never by the codecs themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError

MAX_RAW_LENGTH = 1 << 30
"""A chunk's raw length is at most 1 GiB (the largest ``chunk_bytes``): a reader refuses a
larger one before allocating anything."""

ZSTD_MAX_RATIO = 1 << 15
"""zstd cannot expand a frame by more than this (one 128 KiB RLE block costs 4 bytes): a frame
declaring more is refused before its output is allocated."""


class Codec(ABC):
    """One codec: its names in the format, its encoder and its two decoders.

    Attributes:
        name: the name recorded for each chunk of this codec (index rows, FORMAT.md section 5).
            Never reused for another layout.
        pack_id: the byte a pack's trailer stores for this codec (FORMAT.md section 6). Never
            reused; the registered codecs' ids are ``0 .. n-1``.
        pack_version: the first pack version that may hold a chunk of this codec: a pack
            takes the highest version its chunks need, so a reader that predates the codec
            refuses the pack by its version (and asks for an upgrade) instead of misreading it.
        inner: for a delta codec, the codec of its payload (the XOR of the chunk's raw bytes
            with its base's, FORMAT.md section 5.1); None for a codec of whole chunks.

    Contract of the methods (the registry's :func:`~ckstore.objects.codecs.decode` and
    :func:`~ckstore.objects.codecs.decode_hashed` check their arguments before calling one):

    * ``raw`` and ``payload`` are flat unsigned-byte memoryviews; ``raw_length`` is between 0
      and :data:`MAX_RAW_LENGTH`; ``out`` is None or a writable flat unsigned-byte memoryview
      of exactly ``raw_length`` bytes.
    * A decoder MUST raise :class:`~ckstore.errors.CorruptionError` for any payload that does
      not decode to exactly ``raw_length`` bytes (malformed header, lengths, frame or trailing
      bytes), and MUST check the lengths a payload declares before allocating for them.
    * Decoding is deterministic: a payload that decoded to bytes verified against their id
      once decodes to the same bytes again (what ``ObjectStore.trust`` relies on).
    * Every method is safe to call from many threads at once (any state is per thread) and
      does its heavy work in zstd or NumPy with the GIL released. None imports NumPy or torch
      at module level: reading an index or a raw chunk never loads NumPy.
    """

    name: str
    pack_id: int
    pack_version: int = 1
    inner: Codec | None = None

    def fits(self, raw_length: int, itemsize: int) -> bool:
        """Whether :meth:`encode` takes a chunk of ``raw_length`` bytes of ``itemsize``-byte
        elements (a byte-grouped layout needs whole elements, for one)."""
        return True

    @abstractmethod
    def encode(self, raw: memoryview, itemsize: int, level: int, buffer: Any) -> bytes | memoryview:
        """The payload of a chunk (for a delta codec: of its XOR bytes) that :meth:`fits`.

        Args:
            raw: the raw bytes.
            itemsize: bytes per element of the tensor the chunk comes from.
            level: the zstd level, for a codec that has one.
            buffer: None, or a writable 1-D byte buffer (a ``bytearray`` or a ``uint8``
                ndarray) that a codec building its payload in place uses when it is large
                enough; the payload may then be a view into it (or into ``raw``).

        Returns:
            The payload, however large: whether it pays is the writer's call.
        """

    @abstractmethod
    def decode(
        self, payload: memoryview, raw_length: int, out: memoryview | None
    ) -> bytes | memoryview:
        """The raw bytes of a chunk (for a delta codec: its XOR bytes): ``out`` itself, filled,
        when given; else new memory, or ``payload`` for a codec that stores the bytes as they
        are.

        Raises:
            CorruptionError: the payload does not decode to exactly ``raw_length`` bytes.
        """

    @abstractmethod
    def decode_hashed(
        self, payload: memoryview, raw_length: int, out: memoryview | None, hasher: Any
    ) -> None:
        """Decode into ``out`` (None: keep nothing, verify only) in one pass, feeding every
        decoded byte, in order, to ``hasher.update`` (when ``hasher`` is not None) while it is
        still in the CPU cache: what every verified read of a chunk runs.

        Raises:
            CorruptionError: as for :meth:`decode`.
        """


COPY_BLOCK = 1 << 20
"""Bytes copied and hashed at a time by :func:`hash_and_copy`: a block is hashed right after it
is copied, while it is still in the CPU cache."""


def hash_and_copy(data: Any, out: memoryview | None, hasher: Any) -> None:
    """Copy ``data`` (the decoded bytes, whole) into ``out`` and feed it to ``hasher``: the
    :meth:`Codec.decode_hashed` of a codec that decodes a chunk in one piece.

    Block by block, each block hashed from ``out`` right after it is copied: one pass over
    memory, and the hash covers what landed in ``out`` (the copy too). Without ``out``,
    ``data`` is hashed as it is."""
    if out is None:
        if hasher is not None:
            hasher.update(data)
        return
    import numpy as np  # here: reading an index or a raw chunk never loads numpy

    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.frombuffer(out, dtype=np.uint8)
    if hasher is None:  # numpy copies with the GIL released (a memoryview copy holds it)
        np.copyto(dst, src)
        return
    for s in range(0, len(src), COPY_BLOCK):
        e = s + COPY_BLOCK
        np.copyto(dst[s:e], src[s:e])
        hasher.update(dst[s:e])


def check_out(out: Any, raw_length: int) -> memoryview | None:
    """``out`` (a writable buffer for a chunk of ``raw_length`` bytes, or None) as the flat
    unsigned-byte memoryview a codec decodes into.

    Raises:
        InvalidInputError: ``out`` is read-only or has another length.
    """
    if out is None:
        return None
    target = memoryview(out)
    if target.readonly:
        raise InvalidInputError("decode: out buffer is read-only")
    target = target.cast("B") if target.format != "B" or target.ndim != 1 else target
    if len(target) != raw_length:
        raise InvalidInputError(f"decode: out has {len(target)} bytes, chunk has {raw_length}")
    return target


def check_raw_length(raw_length: int) -> None:
    """Refuse a raw length outside ``0 .. MAX_RAW_LENGTH`` before anything is allocated for it.

    Raises:
        CorruptionError: the length is impossible (a damaged index row or pack entry).
    """
    if not 0 <= raw_length <= MAX_RAW_LENGTH:
        raise CorruptionError(f"raw length {raw_length} is outside 0 to {MAX_RAW_LENGTH}")
