"""The XOR delta: a chunk stored as its bits XORed with those of a base chunk of the same length.

Between two saves of a training run (or a fine-tune and its base model) most elements of a
tensor change only in their low mantissa bits: XORing the new bits with the old ones leaves
sign, exponent and high mantissa bytes mostly zero, which byte grouping then compresses far
better than the raw bytes. The chunk's id stays the BLAKE3 of its raw bytes, so dedup,
verification and the index mean the same with or without deltas.

* :func:`encode_delta` builds a delta payload, or returns None when it does not beat the
  chunk's plain encoding by ``MIN_DELTA_SAVING`` (the writer then stores the chunk whole).
* :func:`xor_into` applies one: ``target ^= other``, in place, with the GIL released.

A delta's base may itself be a delta; readers apply the XOR bytes of every link of the chain
on top of the full chunk at its root (XOR is associative, so one scratch buffer suffices).
"""

from __future__ import annotations

from typing import Any

from ckstore.errors import InvalidInputError
from ckstore.objects.codecs import (
    BYTEGROUP_ZSTD,
    DELTA_OF,
    MIN_SAVING,
    NONE,
    encode,
    encode_grouped_xor,
)
from ckstore.objects.hashing import as_bytes_view

MIN_DELTA_SAVING = 0.02
"""A delta is kept only if it is at least this fraction smaller than the chunk's plain payload
(reading it costs a second payload, so a tie goes to the whole chunk)."""

SURE_DELTA_RATIO = 0.5
"""A delta at most this fraction of the raw size is kept without encoding the chunk plainly to
compare: plain byte-grouped floats of weights and optimizer state stay above it (measured
68-83%), so comparing would only cost a second compression."""

MAX_CHAIN = 64
"""Hard limit on a chain's length a reader follows (the writer's depth limit is far lower):
a longer or cyclic chain is corruption, not data."""


def xor_into(target: Any, other: Any) -> None:
    """``target ^= other`` byte by byte (both the same length; ``target`` writable)."""
    import numpy as np  # here: reading an index never loads numpy

    t = np.frombuffer(target, dtype=np.uint8)
    o = np.frombuffer(as_bytes_view(other), dtype=np.uint8)
    if t.shape != o.shape:
        raise InvalidInputError(f"xor of {t.size} bytes with {o.size} bytes")
    np.bitwise_xor(t, o, out=t)


def encode_delta(
    raw: Any,
    base: Any,
    itemsize: int,
    grouped: bool,
    *,
    level: int = 1,
    scratch: Any = None,
    buffer: Any = None,
    plain_estimate: int | None = None,
    base_planes: Any = None,
) -> tuple[str, bytes | memoryview]:
    """Encode ``raw`` as a delta against ``base`` when that pays, else as ``codecs.encode`` would.

    Args:
        raw, base: the chunk's raw bytes and its base's (verified) raw bytes, equal lengths.
        itemsize, grouped, level: as for ``codecs.encode``.
        scratch: optional writable buffer of at least ``len(raw)`` bytes for the XOR bytes.
        buffer: optional buffer for the delta's byte-grouped layout (as for ``codecs.encode``).
        plain_estimate: what the chunk's plain payload would take, if the caller knows (e.g.
            the stored length of the full chunk at the root of the base's chain, which holds
            the same kind of data): a delta clearly below it is kept without encoding the
            chunk plainly to compare; otherwise the comparison is made.
        base_planes: instead of ``base`` (pass None), the base's byte planes (a
            ``(itemsize, n / itemsize)`` uint8 array) for a ``grouped`` chunk: the XOR is taken
            plane by plane and the base is never interleaved.

    Returns:
        ``(codec, payload)``: a delta codec when the delta is at most ``SURE_DELTA_RATIO`` of
        the raw size or at least ``MIN_DELTA_SAVING`` smaller than the plain payload; else the
        plain encoding. The payload may be a view into ``buffer`` or ``raw``.

    Raises:
        InvalidInputError: the lengths differ.
    """
    import numpy as np

    rview = as_bytes_view(raw)
    n = len(rview)
    if base_planes is not None:
        if n == 0 or not grouped:
            raise InvalidInputError("base planes are for byte-grouped chunks")
        payload: bytes | memoryview = encode_grouped_xor(
            rview, itemsize, base_planes, level, buffer
        )
        inner = BYTEGROUP_ZSTD if len(payload) <= n * (1.0 - MIN_SAVING) else NONE
    else:
        bview = as_bytes_view(base)
        if len(bview) != n:
            raise InvalidInputError(
                f"a delta needs a base of the same length ({len(bview)} != {n} bytes)"
            )
        if n == 0:
            return encode(raw, itemsize, grouped, level)
        if scratch is not None and len(scratch) >= n:
            xor = np.frombuffer(scratch, dtype=np.uint8, count=n)
        else:
            xor = np.empty(n, dtype=np.uint8)
        np.bitwise_xor(
            np.frombuffer(rview, dtype=np.uint8), np.frombuffer(bview, dtype=np.uint8), out=xor
        )
        inner, payload = encode(memoryview(xor.data), itemsize, grouped, level, buffer)
    if inner != NONE and len(payload) <= n * SURE_DELTA_RATIO:
        return DELTA_OF[inner], payload
    if (
        inner != NONE
        and plain_estimate is not None
        and len(payload) <= plain_estimate * (1.0 - MIN_DELTA_SAVING)
    ):
        return DELTA_OF[inner], payload
    codec, plain = encode(raw, itemsize, grouped, level)
    if inner != NONE and len(payload) <= len(plain) * (1.0 - MIN_DELTA_SAVING):
        return DELTA_OF[inner], payload
    return codec, plain
