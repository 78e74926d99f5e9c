"""``bytegroup-zstd`` (pack id 2): the dense codec of floats, and its byte planes.

The raw bytes are a run of ``itemsize``-byte little-endian elements, split into ``itemsize``
planes (plane ``i`` holds byte ``i`` of every element, so the last plane holds sign and exponent
of floats). Payload layout, all integers little-endian::

    u8   version (1)
    u8   itemsize n (2..16)
    n x (u8 flag, u64 stored_length)     flag 0 = plane stored raw, 1 = one zstd frame
    plane 0 payload, plane 1 payload, ... plane n-1 payload (back to back)

Each plane's raw length is ``raw_length / n``. The top plane is always tried with zstd; the
others only if a sample of their first 64 KiB compresses below 90%.

XOR commutes with the grouping, so the delta codec over this one (``xor-bytegroup-zstd``) is
encoded against a base's planes (:func:`encode_grouped_xor`) and a chain of such deltas is
decoded plane by plane (:func:`decoded_planes`) and interleaved once (:func:`interleave_planes`).
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

import zstandard

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.codecs._frames import decode_frame, plane_compressor
from ckstore.objects.codecs.base import ZSTD_MAX_RATIO, Codec, check_out
from ckstore.objects.hashing import as_bytes_view

if TYPE_CHECKING:
    import numpy as np

SAMPLE_BYTES = 64 << 10
"""Size of the sample that decides whether a low-order plane is worth compressing."""

SAMPLE_RATIO = 0.90
"""A low-order plane is compressed only if its sample shrinks below this ratio."""

BLOCK_BYTES = 1 << 20
"""Byte-grouped chunks are re-interleaved (and hashed) in blocks of about this many bytes.
Measured: hashing each 1 MiB block right after it is written is ~8% faster than
re-interleaving the whole 4 MiB chunk and hashing it afterwards."""

_VERSION = 1
_HEAD = struct.Struct("<BB")
_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD = 0, 1

_local = threading.local()


class BytegroupCodec(Codec):
    """Byte planes, each stored raw or as one zstd frame."""

    name = "bytegroup-zstd"
    pack_id = 2

    def fits(self, raw_length: int, itemsize: int) -> bool:
        """Whole elements of 2 to 16 bytes."""
        return 2 <= itemsize <= 16 and raw_length % itemsize == 0

    def encode(self, raw: memoryview, itemsize: int, level: int, buffer: Any) -> memoryview:
        """The planes laid out in ``buffer`` when it holds :func:`grouped_size` bytes."""
        return encode_grouped(raw, itemsize, level, buffer)

    def decode(
        self, payload: memoryview, raw_length: int, out: memoryview | None
    ) -> bytes | memoryview:
        """The planes interleaved into ``out`` (or new memory)."""
        result = out if out is not None else memoryview(bytearray(raw_length))
        _ungroup(payload, raw_length, result, None)
        return result

    def decode_hashed(
        self, payload: memoryview, raw_length: int, out: memoryview | None, hasher: Any
    ) -> None:
        """The planes interleaved block by block (``BLOCK_BYTES``), each block hashed right
        after it is written."""
        _ungroup(payload, raw_length, out, hasher)


CODEC = BytegroupCodec()


def grouped_size(raw_length: int, itemsize: int) -> int:
    """Bytes the byte-grouped layout needs before compression (header, table, planes)."""
    return _HEAD.size + itemsize * _PLANE.size + raw_length


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
    return encode_grouped(view, itemsize, level, buffer, base_planes)


def encode_grouped(
    view: memoryview, itemsize: int, level: int, buffer: Any, xor_planes: Any = None
) -> memoryview:
    """The ``bytegroup-zstd`` payload of ``view`` (XORed plane by plane with ``xor_planes``
    when given), built in ``buffer`` when it holds :func:`grouped_size` bytes.

    ``view`` is split into planes written straight into the payload buffer, then the planes
    that pay are compressed in place (each result is no longer than its plane, so it only ever
    moves left): one transposing copy, and no join of the parts afterwards.
    """
    import numpy as np  # here: reading an index or a plain chunk never loads numpy

    n = len(view)
    plane_len = n // itemsize
    head = _HEAD.size + itemsize * _PLANE.size
    if buffer is not None and len(buffer) >= head + n:
        out = buffer
    else:
        out = np.empty(head + n, dtype=np.uint8)  # every byte used is written below
    body = np.frombuffer(out, dtype=np.uint8, count=n, offset=head).reshape(itemsize, plane_len)
    body[...] = np.frombuffer(view, dtype=np.uint8).reshape(plane_len, itemsize).T
    if xor_planes is not None:
        for i, plane in enumerate(xor_planes):
            np.bitwise_xor(body[i], plane, out=body[i])
    cctx = plane_compressor(level)
    _HEAD.pack_into(out, 0, _VERSION, itemsize)
    flat = np.frombuffer(out, dtype=np.uint8)
    pos = head
    for i in range(itemsize):
        plane = memoryview(body[i])
        flag, stored = _RAW, plane_len
        if i == itemsize - 1 or _sample_pays(cctx, plane):
            packed = cctx.compress(plane)
            if len(packed) < plane_len:
                flag, stored = _ZSTD, len(packed)
                flat[pos : pos + stored] = np.frombuffer(packed, dtype=np.uint8)
        if flag == _RAW and pos != head + i * plane_len:
            flat[pos : pos + plane_len] = body[i]  # numpy copes with the overlap
        _PLANE.pack_into(out, _HEAD.size + i * _PLANE.size, flag, stored)
        pos += stored
    return memoryview(out)[:pos]


def _sample_pays(cctx: zstandard.ZstdCompressor, plane: memoryview) -> bool:
    sample = plane[:SAMPLE_BYTES]
    return len(cctx.compress(sample)) < len(sample) * SAMPLE_RATIO


def _parse(pview: memoryview, raw_length: int) -> tuple[int, list[tuple[int, memoryview]]]:
    """(itemsize, [(flag, plane payload)]) of a byte-grouped payload, validated."""
    if len(pview) < _HEAD.size:
        raise CorruptionError("byte-grouped payload too short for its header")
    version, n = _HEAD.unpack_from(pview, 0)
    if version != _VERSION or not 2 <= n <= 16 or raw_length % n:
        raise CorruptionError(f"bad byte-grouped header (version {version}, itemsize {n})")
    pos = _HEAD.size + n * _PLANE.size
    if len(pview) < pos:
        raise CorruptionError("byte-grouped payload too short for its plane table")
    planes = []
    for i in range(n):
        flag, length = _PLANE.unpack_from(pview, _HEAD.size + i * _PLANE.size)
        plane_len = raw_length // n
        fits = length == plane_len if flag == _RAW else plane_len <= (length + 1) * ZSTD_MAX_RATIO
        if flag not in (_RAW, _ZSTD) or pos + length > len(pview) or not fits:
            raise CorruptionError(f"bad byte-grouped plane {i} (flag {flag}, length {length})")
        planes.append((flag, pview[pos : pos + length]))
        pos += length
    if pos != len(pview):
        raise CorruptionError(f"byte-grouped payload has {len(pview) - pos} trailing bytes")
    return n, planes


def _ungroup(pview: memoryview, raw_length: int, target: memoryview | None, hasher: Any) -> None:
    """Re-interleave a byte-grouped payload into ``target`` (None: a scratch block), block by
    block, feeding each block to ``hasher`` right after it is written."""
    planes = decoded_planes(pview, raw_length)
    _interleave(planes, len(planes), raw_length // len(planes), target, hasher)


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


def itemsize_of(payload: Any) -> int | None:
    """The element size a byte-grouped payload declares (None if it is too short to say)."""
    pview = as_bytes_view(payload)
    return int(pview[1]) if len(pview) >= _HEAD.size else None


def decoded_planes(payload: Any, raw_length: int) -> list[Any]:
    """The byte planes of a (delta's) byte-grouped payload, as uint8 arrays: views into
    ``payload`` for planes stored raw, new arrays for compressed ones.

    Raises:
        CorruptionError: a malformed payload.
    """
    import numpy as np

    n, parts = _parse(as_bytes_view(payload), raw_length)
    plane_len = raw_length // n
    out = []
    for i, (flag, body) in enumerate(parts):
        plane = np.frombuffer(
            decode_frame(body, plane_len) if flag == _ZSTD else body, dtype=np.uint8
        )
        if len(plane) != plane_len:
            raise CorruptionError(
                f"byte-grouped plane {i} has {len(plane)} bytes, expected {plane_len}"
            )
        out.append(plane)
    return out


def interleave_planes(planes: Any, target: memoryview | None, hasher: Any) -> None:
    """Interleave the ``(n, plane_len)`` array ``planes`` into ``target`` (None: hash only),
    hashing as it goes: XOR commutes with
    the byte grouping, so a chain of byte-grouped deltas is applied plane by plane
    (:func:`decoded_planes`) and interleaved once."""
    n, plane_len = planes.shape
    _interleave(list(planes), n, plane_len, check_out(target, n * plane_len), hasher)


def _block_scratch(n: int) -> np.ndarray:
    """This thread's reusable block buffer of at least ``n`` bytes."""
    import numpy as np

    buf: np.ndarray | None = getattr(_local, "block", None)
    if buf is None or len(buf) < n:
        buf = _local.block = np.empty(n, dtype=np.uint8)
    return buf
