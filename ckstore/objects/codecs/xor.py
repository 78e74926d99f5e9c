"""``xor-zstd`` (pack id 3) and ``xor-bytegroup-zstd`` (pack id 4): deltas.

A delta's payload is the ``zstd`` / ``bytegroup-zstd`` payload of its *XOR bytes*: the chunk's
raw bytes XORed with those of its base chunk (same length; the pack entry names the base, so
packs holding one are at least version 2). These codecs encode and decode the XOR bytes only:
:mod:`ckstore.objects.delta` builds a delta and the object store applies one to its base.
"""

from __future__ import annotations

from typing import Any

from ckstore.objects.codecs import bytegroup, zstd
from ckstore.objects.codecs.base import Codec


class XorCodec(Codec):
    """A delta whose XOR bytes are stored with ``inner``.

    Args:
        inner: the codec of the XOR bytes.
        pack_id: this codec's id in a pack's trailer.
    """

    pack_version = 2
    inner: Codec

    def __init__(self, inner: Codec, pack_id: int) -> None:
        self.name = f"xor-{inner.name}"
        self.pack_id = pack_id
        self.inner = inner

    def fits(self, raw_length: int, itemsize: int) -> bool:
        """As its inner codec."""
        return self.inner.fits(raw_length, itemsize)

    def encode(self, raw: memoryview, itemsize: int, level: int, buffer: Any) -> bytes | memoryview:
        """The inner codec's payload of the XOR bytes ``raw``."""
        return self.inner.encode(raw, itemsize, level, buffer)

    def decode(
        self, payload: memoryview, raw_length: int, out: memoryview | None
    ) -> bytes | memoryview:
        """The XOR bytes."""
        return self.inner.decode(payload, raw_length, out)

    def decode_hashed(
        self, payload: memoryview, raw_length: int, out: memoryview | None, hasher: Any
    ) -> None:
        """The XOR bytes, hashed as they are decoded (the chunk's id is checked on the bytes
        the chain decodes to, not on these)."""
        self.inner.decode_hashed(payload, raw_length, out, hasher)


XOR_ZSTD = XorCodec(zstd.CODEC, 3)
XOR_BYTEGROUP_ZSTD = XorCodec(bytegroup.CODEC, 4)
