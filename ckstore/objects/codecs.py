"""Per-chunk codecs, named by strings: ``"none"``, ``"zstd"``, ``"bytegroup-zstd"``, the two
delta codecs ``"xor-zstd"`` and ``"xor-bytegroup-zstd"``, and ``"exp-zstd"`` (the take's fast
codec for floats, :mod:`ckstore.objects.expzstd`).

A chunk's id is always the hash of its raw bytes; the codec only changes how it is stored.

* ``none``: the payload is the raw bytes.
* ``zstd``: the payload is one zstd frame (with the content size in its header).
* ``bytegroup-zstd``: the raw bytes are a run of ``itemsize``-byte little-endian elements,
  split into ``itemsize`` planes (plane ``i`` holds byte ``i`` of every element, so the last
  plane holds sign and exponent of floats). Payload layout, all integers little-endian::

      u8   version (1)
      u8   itemsize n (2..16)
      n x (u8 flag, u64 stored_length)     flag 0 = plane stored raw, 1 = one zstd frame
      plane 0 payload, plane 1 payload, ... plane n-1 payload (back to back)

  Each plane's raw length is ``raw_length / n``. The top plane is always tried with zstd;
  the others only if a sample of their first 64 KiB compresses below 90%.

* ``xor-zstd`` / ``xor-bytegroup-zstd``: a delta. The payload is the ``zstd`` /
  ``bytegroup-zstd`` payload of the chunk's raw bytes XORed with the raw bytes of its base
  chunk (same length; the pack entry names the base, see ``packs.py``). Decoding one needs the
  base's raw bytes: :func:`decode` and :func:`decode_hashed` decode only the XOR bytes
  (``delta_inner`` names the codec they use); ``objects.delta`` and the object store apply it.
* ``exp-zstd``: the sign-and-exponent byte plane of 2- or 4-byte floats as one zstd frame, the
  other bytes raw (layout in :mod:`ckstore.objects.expzstd`). Several times faster to encode
  and decode than ``bytegroup-zstd``, within about 1% of its ratio: what a take writes
  (``encode(..., fast=True)``); compaction rewrites older snapshots densely.

:func:`encode` falls back to ``("none", raw)`` (no copy) when compression saves less than
about 3%. Compressor objects are per thread (zstd contexts are not thread-safe); the heavy
work runs in zstd and numpy with the GIL released, so a thread pool scales.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

import zstandard

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.hashing import as_bytes_view

if TYPE_CHECKING:
    import numpy as np

NONE = "none"
ZSTD = "zstd"
BYTEGROUP_ZSTD = "bytegroup-zstd"
XOR_ZSTD = "xor-zstd"
XOR_BYTEGROUP_ZSTD = "xor-bytegroup-zstd"
EXP_ZSTD = "exp-zstd"
CODECS = (NONE, ZSTD, BYTEGROUP_ZSTD, XOR_ZSTD, XOR_BYTEGROUP_ZSTD, EXP_ZSTD)
"""Every codec name this version reads and writes (a pack stores the position as the id)."""
DELTA_CODECS = {XOR_ZSTD: ZSTD, XOR_BYTEGROUP_ZSTD: BYTEGROUP_ZSTD}
"""Delta codec -> the codec of its XOR bytes."""
FAST_CODECS = frozenset({NONE, EXP_ZSTD})
"""What a take writes (``encode(..., fast=True)``): a chunk stored with one of these and not yet
rewritten by compaction is *loose*."""


def is_delta(codec: str) -> bool:
    """Whether chunks of ``codec`` are stored against a base chunk."""
    return codec in DELTA_CODECS


def delta_inner(codec: str) -> str:
    """The codec a chunk's stored bytes decode with: that of the XOR bytes for a delta."""
    return DELTA_CODECS.get(codec, codec)


MIN_SAVING = 0.03
"""Compression must save at least this fraction of the raw size, else the chunk stays raw."""

SAMPLE_BYTES = 64 << 10
"""Size of the sample that decides whether a low-order plane is worth compressing."""

SAMPLE_RATIO = 0.90
"""A low-order plane is compressed only if its sample shrinks below this ratio."""

PLANE_HASH_LOG = 6
"""zstd hash table size (log2 entries) for byte planes. Measured on exponent planes of
normal-distributed and of trained fp32/bf16 weights: 2.8x faster than level 1's default
(17) and about 7% smaller (ratio 0.34 instead of 0.37); decoding is 1.5x faster too."""

MAX_RAW_LENGTH = 1 << 30
"""A chunk's raw length is at most 1 GiB (the largest ``chunk_bytes``): a reader refuses a
larger one before allocating anything."""
ZSTD_MAX_RATIO = 1 << 15
"""zstd cannot expand a frame by more than this (one 128 KiB RLE block costs 4 bytes): a frame
declaring more is refused before its output is allocated."""

_BG_VERSION = 1
_BG_HEAD = struct.Struct("<BB")
_BG_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD_FLAG = 0, 1

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("cctx", {})
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _plane_compressor(level: int) -> zstandard.ZstdCompressor:
    """Compressor for byte planes: a tiny match table (``PLANE_HASH_LOG``) suits their small
    alphabets, so it is both faster and tighter than the level's default there."""
    cache = _local.__dict__.setdefault("plane_cctx", {})
    cctx = cache.get(level)
    if cctx is None:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, hash_log=PLANE_HASH_LOG, write_content_size=True
        )
        cctx = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _worth_it(stored: int, raw: int) -> bool:
    return stored <= raw * (1.0 - MIN_SAVING)


def encode(
    raw: Any, itemsize: int, grouped: bool, level: int = 1, buffer: Any = None, fast: bool = False
) -> tuple[str, bytes | memoryview]:
    """Encode one chunk.

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
    if n == 0:
        return NONE, _original(raw, view)
    payload: bytes | memoryview
    if fast:
        from . import expzstd

        if not (grouped and expzstd.fits(n, itemsize)):
            return NONE, _original(raw, view)
        codec, payload = EXP_ZSTD, expzstd.encode(view, itemsize, buffer)
    elif grouped and 2 <= itemsize <= 16 and n % itemsize == 0:
        codec, payload = BYTEGROUP_ZSTD, _encode_grouped(view, itemsize, level, buffer)
    else:
        codec, payload = ZSTD, _compressor(level).compress(view)
    if not _worth_it(len(payload), n):
        return NONE, _original(raw, view)
    return codec, payload


def _original(raw: Any, view: memoryview) -> bytes | memoryview:
    return raw if isinstance(raw, (bytes, memoryview)) and raw is not view else view


def grouped_size(raw_length: int, itemsize: int) -> int:
    """Bytes the byte-grouped layout needs before compression (header, table, planes)."""
    return _BG_HEAD.size + itemsize * _BG_PLANE.size + raw_length


def encode_grouped_xor(
    raw: Any, itemsize: int, base_planes: Any, level: int = 1, buffer: Any = None
) -> memoryview:
    """The ``bytegroup-zstd`` payload of ``raw`` XOR a base whose byte planes are
    ``base_planes`` (``itemsize`` uint8 arrays of ``len(raw) / itemsize`` bytes, or one such 2-D
    array): XOR commutes with the grouping, so the base is never interleaved. The payload may
    be a view into ``buffer``.

    Raises:
        InvalidInputError: the planes do not fit ``raw``.
    """
    view = as_bytes_view(raw)
    plane_len = len(view) // itemsize
    if (
        len(view) % itemsize
        or len(base_planes) != itemsize
        or any(len(p) != plane_len for p in base_planes)
    ):
        raise InvalidInputError(f"base planes do not fit {len(view)} bytes of itemsize {itemsize}")
    return _encode_grouped(view, itemsize, level, buffer, base_planes)


def _encode_grouped(
    view: memoryview, itemsize: int, level: int, buffer: Any, xor_planes: Any = None
) -> memoryview:
    import numpy as np  # here: reading an index or a plain chunk never loads numpy

    """Split ``view`` into planes written straight into the payload buffer, then compress
    the planes that pay in place (each result is no longer than its plane, so it only ever
    moves left): one transposing copy, and no join of the parts afterwards."""
    n = len(view)
    plane_len = n // itemsize
    head = _BG_HEAD.size + itemsize * _BG_PLANE.size
    if buffer is not None and len(buffer) >= head + n:
        out = buffer
    else:
        out = np.empty(head + n, dtype=np.uint8)  # every byte used is written below
    body = np.frombuffer(out, dtype=np.uint8, count=n, offset=head).reshape(itemsize, plane_len)
    body[...] = np.frombuffer(view, dtype=np.uint8).reshape(plane_len, itemsize).T
    if xor_planes is not None:
        for i, plane in enumerate(xor_planes):
            np.bitwise_xor(body[i], plane, out=body[i])
    cctx = _plane_compressor(level)
    _BG_HEAD.pack_into(out, 0, _BG_VERSION, itemsize)
    flat = np.frombuffer(out, dtype=np.uint8)
    pos = head
    for i in range(itemsize):
        plane = memoryview(body[i])
        flag, stored = _RAW, plane_len
        if i == itemsize - 1 or _sample_pays(cctx, plane):
            packed = cctx.compress(plane)
            if len(packed) < plane_len:
                flag, stored = _ZSTD_FLAG, len(packed)
                flat[pos : pos + stored] = np.frombuffer(packed, dtype=np.uint8)
        if flag == _RAW and pos != head + i * plane_len:
            flat[pos : pos + plane_len] = body[i]  # numpy copes with the overlap
        _BG_PLANE.pack_into(out, _BG_HEAD.size + i * _BG_PLANE.size, flag, stored)
        pos += stored
    return memoryview(out)[:pos]


def _sample_pays(cctx: zstandard.ZstdCompressor, plane: memoryview) -> bool:
    sample = plane[:SAMPLE_BYTES]
    return len(cctx.compress(sample)) < len(sample) * SAMPLE_RATIO


def decode(
    codec: str, payload: Any, raw_length: int, out: memoryview | None = None
) -> bytes | memoryview:
    """Decode one chunk; the inverse of :func:`encode`. For a delta codec, the XOR bytes.

    Args:
        codec: the codec name recorded for the chunk.
        payload: the stored bytes.
        raw_length: the chunk's raw length.
        out: optional writable buffer of exactly ``raw_length`` bytes to decode into.

    Returns:
        The raw bytes (``out`` itself when given).

    Raises:
        CorruptionError: unknown codec, malformed payload or wrong decoded length.
        InvalidInputError: ``out`` is not writable or has the wrong size.
    """
    target = _check_out(out, raw_length)
    pview = as_bytes_view(payload)
    codec = delta_inner(codec)
    if not 0 <= raw_length <= MAX_RAW_LENGTH:
        raise CorruptionError(f"raw length {raw_length} is outside 0 to {MAX_RAW_LENGTH}")
    if codec == NONE:
        result = _decode_none(pview, raw_length, target, payload)
    elif codec == ZSTD:
        result = _zstd_frame(pview, raw_length)
        if target is not None:
            target[:] = result
    elif codec == BYTEGROUP_ZSTD:
        result = _decode_grouped(pview, raw_length, target)
    elif codec == EXP_ZSTD:
        from . import expzstd

        result = target if target is not None else memoryview(bytearray(raw_length))
        expzstd.decode_into(pview, raw_length, result, None)
    else:
        raise CorruptionError(f"unknown codec {codec!r} (this version knows {', '.join(CODECS)})")
    return out if out is not None else result


def _check_out(out: memoryview | None, raw_length: int) -> memoryview | None:
    if out is None:
        return None
    target = memoryview(out)
    if target.readonly:
        raise InvalidInputError("decode: out buffer is read-only")
    target = target.cast("B") if target.format != "B" or target.ndim != 1 else target
    if len(target) != raw_length:
        raise InvalidInputError(f"decode: out has {len(target)} bytes, chunk has {raw_length}")
    return target


def _decode_none(
    pview: memoryview, raw_length: int, target: memoryview | None, payload: Any
) -> bytes | memoryview:
    if len(pview) != raw_length:
        raise CorruptionError(f"raw chunk has {len(pview)} bytes, expected {raw_length}")
    if target is None:
        return payload if isinstance(payload, (bytes, memoryview)) else pview
    target[:] = pview
    return target


def _zstd_frame(pview: memoryview, raw_length: int) -> bytes:
    try:
        size = zstandard.frame_content_size(pview)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"malformed zstd frame: {exc}") from exc
    if size != raw_length:
        raise CorruptionError(f"zstd frame declares {size} bytes, expected {raw_length}")
    if raw_length > (len(pview) + 1) * ZSTD_MAX_RATIO:
        raise CorruptionError(f"a {len(pview)}-byte zstd frame cannot hold {raw_length} bytes")
    try:
        dobj = _decompressor().decompressobj(write_size=max(raw_length, 1))
        data = dobj.decompress(pview)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"malformed zstd frame: {exc}") from exc
    if not dobj.eof or dobj.unused_data:
        raise CorruptionError("zstd frame is incomplete or followed by extra bytes")
    if len(data) != raw_length:
        raise CorruptionError(f"zstd frame decoded to {len(data)} bytes, expected {raw_length}")
    return data


def _parse_grouped(pview: memoryview, raw_length: int) -> tuple[int, list[tuple[int, memoryview]]]:
    """(itemsize, [(flag, plane payload)]) of a byte-grouped payload, validated."""
    if len(pview) < _BG_HEAD.size:
        raise CorruptionError("byte-grouped payload too short for its header")
    version, n = _BG_HEAD.unpack_from(pview, 0)
    if version != _BG_VERSION or not 2 <= n <= 16 or raw_length % n:
        raise CorruptionError(f"bad byte-grouped header (version {version}, itemsize {n})")
    pos = _BG_HEAD.size + n * _BG_PLANE.size
    if len(pview) < pos:
        raise CorruptionError("byte-grouped payload too short for its plane table")
    planes = []
    for i in range(n):
        flag, length = _BG_PLANE.unpack_from(pview, _BG_HEAD.size + i * _BG_PLANE.size)
        plane_len = raw_length // n
        fits = length == plane_len if flag == _RAW else plane_len <= (length + 1) * ZSTD_MAX_RATIO
        if flag not in (_RAW, _ZSTD_FLAG) or pos + length > len(pview) or not fits:
            raise CorruptionError(f"bad byte-grouped plane {i} (flag {flag}, length {length})")
        planes.append((flag, pview[pos : pos + length]))
        pos += length
    if pos != len(pview):
        raise CorruptionError(f"byte-grouped payload has {len(pview) - pos} trailing bytes")
    return n, planes


def _decode_grouped(
    pview: memoryview, raw_length: int, target: memoryview | None
) -> bytes | memoryview:
    result = target if target is not None else memoryview(bytearray(raw_length))
    _ungroup(pview, raw_length, result, None)
    return result


def decode_hashed(
    codec: str, payload: Any, raw_length: int, out: memoryview | None, hasher: Any
) -> None:
    """Decode one chunk, feeding every decoded byte to ``hasher`` (in order) as it is produced.

    One pass over the bytes: a byte-grouped chunk is re-interleaved and hashed block by block
    (``BLOCK_BYTES``), so each block is hashed while it is still in the CPU cache; a raw chunk
    is hashed straight from ``payload``.

    Args:
        codec, payload, raw_length: as for :func:`decode`.
        out: writable buffer of exactly ``raw_length`` bytes to decode into, or None to keep
            nothing (verify only: blocks go through a small per-thread scratch buffer).
        hasher: an object with ``update(buffer)`` (e.g. ``hashing.new_hasher()``), or None.

    Raises:
        CorruptionError, InvalidInputError: as for :func:`decode`.
    """
    import numpy as np  # here: reading an index or a plain chunk never loads numpy

    target = _check_out(out, raw_length)
    pview = as_bytes_view(payload)
    codec = delta_inner(codec)
    if not 0 <= raw_length <= MAX_RAW_LENGTH:
        raise CorruptionError(f"raw length {raw_length} is outside 0 to {MAX_RAW_LENGTH}")
    if codec == NONE:
        if len(pview) != raw_length:
            raise CorruptionError(f"raw chunk has {len(pview)} bytes, expected {raw_length}")
        data: Any = pview
    elif codec == ZSTD:
        data = _zstd_frame(pview, raw_length)
    elif codec == BYTEGROUP_ZSTD:
        _ungroup(pview, raw_length, target, hasher)
        return
    elif codec == EXP_ZSTD:
        from . import expzstd

        expzstd.decode_into(pview, raw_length, target, hasher)
        return
    else:
        raise CorruptionError(f"unknown codec {codec!r} (this version knows {', '.join(CODECS)})")
    if hasher is not None:
        hasher.update(data)
    if target is not None:  # numpy copies with the GIL released (a memoryview copy holds it)
        np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


BLOCK_BYTES = 1 << 20
"""Byte-grouped chunks are re-interleaved (and hashed) in blocks of about this many bytes.
Measured: hashing each 1 MiB block right after it is written is ~8% faster than
re-interleaving the whole 4 MiB chunk and hashing it afterwards."""


def _ungroup(pview: memoryview, raw_length: int, target: memoryview | None, hasher: Any) -> None:
    """Re-interleave a byte-grouped payload into ``target`` (None: a scratch block), block by
    block, feeding each block to ``hasher`` right after it is written."""
    import numpy as np

    n, planes = _parse_grouped(pview, raw_length)
    plane_len = raw_length // n
    data = []
    for i, (flag, body) in enumerate(planes):
        plane = _zstd_frame(body, plane_len) if flag == _ZSTD_FLAG else body
        if len(plane) != plane_len:
            raise CorruptionError(
                f"byte-grouped plane {i} has {len(plane)} bytes, expected {plane_len}"
            )
        data.append(np.frombuffer(plane, dtype=np.uint8))
    _interleave(data, n, plane_len, target, hasher)


def _interleave(
    data: list[Any], n: int, plane_len: int, target: memoryview | None, hasher: Any
) -> None:
    """Write the ``n`` planes ``data`` interleaved into ``target`` (None: a scratch block), in
    blocks of about ``BLOCK_BYTES``, feeding each block to ``hasher`` right after it is written."""
    import numpy as np

    step = max(1, BLOCK_BYTES // n)  # elements per block
    dest = np.frombuffer(target, dtype=np.uint8) if target is not None else None
    for start in range(0, plane_len, step):
        stop = min(plane_len, start + step)
        if dest is not None:
            block = dest[start * n : stop * n]
        else:
            block = _block_scratch(step * n)[: (stop - start) * n]
        grid = block.reshape(-1, n)
        for i, column in enumerate(data):
            grid[:, i] = column[start:stop]
        if hasher is not None:
            hasher.update(block)


def grouped_itemsize(codec: str, payload: Any) -> int | None:
    """The element size of a (delta's) byte-grouped payload, or None for any other codec."""
    if delta_inner(codec) != BYTEGROUP_ZSTD:
        return None
    pview = as_bytes_view(payload)
    return int(pview[1]) if len(pview) >= _BG_HEAD.size else None


def decoded_planes(payload: Any, raw_length: int) -> list[Any]:
    """The byte planes of a (delta's) byte-grouped payload, as uint8 arrays: views into
    ``payload`` for planes stored raw, new arrays for compressed ones.

    Raises:
        CorruptionError: a malformed payload.
    """
    import numpy as np

    n, parts = _parse_grouped(as_bytes_view(payload), raw_length)
    plane_len = raw_length // n
    out = []
    for i, (flag, body) in enumerate(parts):
        plane = np.frombuffer(
            _zstd_frame(body, plane_len) if flag == _ZSTD_FLAG else body, dtype=np.uint8
        )
        if len(plane) != plane_len:
            raise CorruptionError(
                f"byte-grouped plane {i} has {len(plane)} bytes, expected {plane_len}"
            )
        out.append(plane)
    return out


def interleave_planes(planes: Any, target: memoryview | None, hasher: Any) -> None:
    """Interleave the ``(n, plane_len)`` array ``planes`` into ``target`` (None: hash only),
    hashing as it goes: XOR commutes with the byte grouping, so a chain of byte-grouped deltas
    is applied plane by plane (:func:`decoded_planes`) and interleaved once."""
    n, plane_len = planes.shape
    _interleave(list(planes), n, plane_len, _check_out(target, n * plane_len), hasher)


def _block_scratch(n: int) -> np.ndarray:
    """This thread's reusable block buffer of at least ``n`` bytes."""
    import numpy as np

    buf: np.ndarray | None = getattr(_local, "block", None)
    if buf is None or len(buf) < n:
        buf = _local.block = np.empty(n, dtype=np.uint8)
    return buf
