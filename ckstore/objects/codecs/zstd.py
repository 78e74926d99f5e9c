"""``zstd`` (pack id 1): the payload is one zstd frame with the content size in its header and
nothing after it. The dense codec of anything but floats (integers, bool, 1-byte floats)."""

from __future__ import annotations

from typing import Any

from ckstore.objects.codecs._frames import compressor, decode_frame
from ckstore.objects.codecs.base import Codec, hash_and_copy


class ZstdCodec(Codec):
    """One zstd frame of the whole chunk."""

    name = "zstd"
    pack_id = 1

    def encode(self, raw: memoryview, itemsize: int, level: int, buffer: Any) -> bytes:
        """One frame at ``level`` (``buffer`` is not used)."""
        return compressor(level).compress(raw)

    def decode(
        self, payload: memoryview, raw_length: int, out: memoryview | None
    ) -> bytes | memoryview:
        """The frame's content (new bytes), copied into ``out`` when given."""
        data = decode_frame(payload, raw_length)
        if out is None:
            return data
        out[:] = data
        return out

    def decode_hashed(
        self, payload: memoryview, raw_length: int, out: memoryview | None, hasher: Any
    ) -> None:
        """The frame decoded whole, then hashed and copied into ``out``."""
        hash_and_copy(decode_frame(payload, raw_length), out, hasher)


CODEC = ZstdCodec()
