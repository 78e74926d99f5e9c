"""Per-chunk codecs, named by strings, and the choice of one for a whole chunk (:func:`encode`).

A chunk's id is always the hash of its raw bytes; the codec only changes how it is stored. One
module per codec, each a :class:`~ckstore.objects.codecs.base.Codec` registered by name in
:mod:`~ckstore.objects.codecs.registry` (the layouts are in FORMAT.md section 5):

* ``none`` (:mod:`.none`): the raw bytes.
* ``zstd`` (:mod:`.zstd`): one zstd frame, the content size in its header.
* ``bytegroup-zstd`` (:mod:`.bytegroup`): byte planes, each raw or one zstd frame; the dense
  codec of floats.
* ``xor-zstd`` / ``xor-bytegroup-zstd`` (:mod:`.xor`): a delta, the ``zstd`` /
  ``bytegroup-zstd`` payload of the chunk's bytes XORed with its base's. :func:`decode` and
  :func:`decode_hashed` decode only the XOR bytes (``delta_inner`` names the codec they use);
  ``objects.delta`` builds a delta and the object store applies one.
* ``exp-zstd`` (:mod:`.expzstd`): the sign-and-exponent byte plane of 2- or 4-byte floats as
  one zstd frame, the other bytes raw. Several times faster to encode and decode than
  ``bytegroup-zstd``, within about 1% of its ratio: what a take with ``take_codec="fast"``
  writes (``encode(..., fast=True)``; the default take stores chunks as they are); compaction
  rewrites older snapshots densely.

:func:`encode` falls back to ``("none", raw)`` (no copy) when compression saves less than
about 3%. Compressor objects are per thread (zstd contexts are not thread-safe); the heavy
work runs in zstd and numpy with the GIL released, so a thread pool scales.
"""

from __future__ import annotations

from typing import Any

from ckstore.objects.codecs import bytegroup, expzstd, none, xor, zstd
from ckstore.objects.codecs._frames import PLANE_HASH_LOG
from ckstore.objects.codecs.base import MAX_RAW_LENGTH, ZSTD_MAX_RATIO, Codec, check_out
from ckstore.objects.codecs.bytegroup import (
    decoded_planes,
    encode_grouped_xor,
    grouped_size,
    interleave_planes,
)
from ckstore.objects.codecs.registry import (
    CODECS,
    DELTA_CODECS,
    DELTA_OF,
    codec,
    decode,
    decode_hashed,
    delta_inner,
    grouped_itemsize,
    is_delta,
)
from ckstore.objects.hashing import as_bytes_view

NONE = none.CODEC.name
ZSTD = zstd.CODEC.name
BYTEGROUP_ZSTD = bytegroup.CODEC.name
XOR_ZSTD = xor.XOR_ZSTD.name
XOR_BYTEGROUP_ZSTD = xor.XOR_BYTEGROUP_ZSTD.name
EXP_ZSTD = expzstd.CODEC.name

FAST_CODECS = frozenset({NONE, EXP_ZSTD})
"""What a take writes (``encode(..., fast=True)``): a chunk stored with one of these and not yet
rewritten by compaction is *loose*."""

MIN_SAVING = 0.03
"""Compression must save at least this fraction of the raw size, else the chunk stays raw."""


def encode(
    raw: Any, itemsize: int, grouped: bool, level: int = 1, buffer: Any = None, fast: bool = False
) -> tuple[str, bytes | memoryview]:
    """Encode one chunk: choose its codec and run it.

    Args:
        raw: the chunk's raw bytes (any contiguous buffer; not copied if left raw).
        itemsize: bytes per element of the tensor the chunk comes from.
        grouped: use byte grouping (the caller says so for floating/complex dtypes with
            ``itemsize >= 2``); ignored if the chunk is not a whole number of elements.
        level: zstd level (1 is best for weights: fast, and no worse on the exponent plane).
        buffer: optional writable 1-D byte buffer (a ``bytearray`` or a ``uint8`` ndarray) the
            byte-grouped layout is built in if it is large enough
            (``grouped_size(len(raw), itemsize)``); recycling buffers spares the page faults
            of a fresh allocation per chunk. The payload may then be a view into it.
        fast: the take's critical path: ``exp-zstd`` for 2- and 4-byte floats, and no
            compression for anything else (compaction compresses those later).

    Returns:
        ``(codec, payload)``; ``("none", raw)`` if compression does not pay.
    """
    view = as_bytes_view(raw)
    n = len(view)
    chosen: Codec | None
    if n == 0:
        chosen = None
    elif fast:
        chosen = expzstd.CODEC if grouped and expzstd.CODEC.fits(n, itemsize) else None
    elif grouped and bytegroup.CODEC.fits(n, itemsize):
        chosen = bytegroup.CODEC
    else:
        chosen = zstd.CODEC
    if chosen is not None:
        payload = chosen.encode(view, itemsize, level, buffer)
        if len(payload) <= n * (1.0 - MIN_SAVING):
            return chosen.name, payload
    return NONE, raw if isinstance(raw, (bytes, memoryview)) and raw is not view else view


__all__ = [
    "BYTEGROUP_ZSTD",
    "CODECS",
    "DELTA_CODECS",
    "DELTA_OF",
    "EXP_ZSTD",
    "FAST_CODECS",
    "MAX_RAW_LENGTH",
    "MIN_SAVING",
    "NONE",
    "PLANE_HASH_LOG",
    "XOR_BYTEGROUP_ZSTD",
    "XOR_ZSTD",
    "ZSTD",
    "ZSTD_MAX_RATIO",
    "Codec",
    "check_out",
    "codec",
    "decode",
    "decode_hashed",
    "decoded_planes",
    "delta_inner",
    "encode",
    "encode_grouped_xor",
    "grouped_itemsize",
    "grouped_size",
    "interleave_planes",
    "is_delta",
]
