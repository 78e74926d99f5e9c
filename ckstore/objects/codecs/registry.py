"""Every codec this version reads and writes, by name and by pack id, and decoding by name.

Adding a codec: a module in this package with a :class:`~ckstore.objects.codecs.base.Codec`
(the next free pack id, the pack version that first holds it), one line in :data:`REGISTERED`,
its section and test vector in FORMAT.md; then the writer (``codecs.encode`` or
``delta.encode_delta``) may choose it.
"""

from __future__ import annotations

from typing import Any

from ckstore.errors import CorruptionError
from ckstore.objects.codecs import bytegroup, expzstd, none, xor, zstd
from ckstore.objects.codecs.base import Codec, check_out, check_raw_length
from ckstore.objects.hashing import as_bytes_view

REGISTERED: tuple[Codec, ...] = (
    none.CODEC,
    zstd.CODEC,
    bytegroup.CODEC,
    xor.XOR_ZSTD,
    xor.XOR_BYTEGROUP_ZSTD,
    expzstd.CODEC,
)
"""The codecs, in pack id order (each name and pack id once: ``tests/objects`` checks)."""

_BY_NAME: dict[str, Codec] = {c.name: c for c in REGISTERED}

CODECS: tuple[str, ...] = tuple(c.name for c in REGISTERED)
"""Every codec name this version reads and writes, in pack id order."""

DELTA_CODECS: dict[str, str] = {c.name: c.inner.name for c in REGISTERED if c.inner is not None}
"""Delta codec -> the codec of its XOR bytes."""

DELTA_OF: dict[str, str] = {inner: delta for delta, inner in DELTA_CODECS.items()}
"""Codec of whole chunks -> the delta codec whose XOR bytes it stores."""


def codec(name: str) -> Codec:
    """The codec named ``name``.

    Raises:
        CorruptionError: no codec has that name (a damaged row, or a newer writer's codec).
    """
    found = _BY_NAME.get(name)
    if found is None:
        raise CorruptionError(f"unknown codec {name!r} (this version knows {', '.join(CODECS)})")
    return found


def is_delta(name: str) -> bool:
    """Whether chunks of codec ``name`` are stored against a base chunk."""
    return name in DELTA_CODECS


def delta_inner(name: str) -> str:
    """The codec a chunk's stored bytes decode with: that of the XOR bytes for a delta."""
    return DELTA_CODECS.get(name, name)


def decode(name: str, payload: Any, raw_length: int, out: Any = None) -> bytes | memoryview:
    """Decode one chunk; the inverse of ``encode``. For a delta codec, the XOR bytes.

    Args:
        name: the codec name recorded for the chunk.
        payload: the stored bytes.
        raw_length: the chunk's raw length.
        out: optional writable buffer of exactly ``raw_length`` bytes to decode into.

    Returns:
        The raw bytes: ``out`` itself when given; ``payload`` itself (not a copy) for a chunk
        stored raw.

    Raises:
        CorruptionError: unknown codec, malformed payload or wrong decoded length.
        InvalidInputError: ``out`` is not writable or has the wrong size.
    """
    target = check_out(out, raw_length)
    pview = as_bytes_view(payload)
    check_raw_length(raw_length)
    result = codec(name).decode(pview, raw_length, target)
    if out is not None:
        return out
    if result is pview and isinstance(payload, (bytes, memoryview)):
        return payload  # the caller's own object, not a view of it
    return result


def decode_hashed(name: str, payload: Any, raw_length: int, out: Any, hasher: Any) -> None:
    """Decode one chunk, feeding every decoded byte to ``hasher`` (in order) as it is produced.

    One pass over the bytes: a byte-grouped chunk is re-interleaved and hashed block by block,
    so each block is hashed while it is still in the CPU cache; a raw chunk is hashed straight
    from ``payload``.

    Args:
        name, payload, raw_length: as for :func:`decode`.
        out: writable buffer of exactly ``raw_length`` bytes to decode into, or None to keep
            nothing (verify only: blocks go through a small per-thread scratch buffer).
        hasher: an object with ``update(buffer)`` (e.g. ``hashing.new_hasher()``), or None.

    Raises:
        CorruptionError, InvalidInputError: as for :func:`decode`.
    """
    target = check_out(out, raw_length)
    pview = as_bytes_view(payload)
    check_raw_length(raw_length)
    codec(name).decode_hashed(pview, raw_length, target, hasher)


def grouped_itemsize(name: str, payload: Any) -> int | None:
    """The element size of a (delta's) byte-grouped payload, or None for any other codec."""
    found = _BY_NAME.get(name)
    if found is None or (found.inner or found) is not bytegroup.CODEC:
        return None
    return bytegroup.itemsize_of(payload)
