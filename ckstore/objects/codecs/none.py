"""``none`` (pack id 0): the payload is the raw bytes. What a chunk is stored as when no
compression pays, and what a take writes for anything but 2- and 4-byte floats."""

from __future__ import annotations

from typing import Any

from ckstore.errors import CorruptionError
from ckstore.objects.codecs.base import Codec, hash_and_copy


class NoneCodec(Codec):
    """The raw bytes as they are: the payload length is the raw length."""

    name = "none"
    pack_id = 0

    def encode(self, raw: memoryview, itemsize: int, level: int, buffer: Any) -> memoryview:
        """``raw`` itself: nothing is copied."""
        return raw

    def decode(
        self, payload: memoryview, raw_length: int, out: memoryview | None
    ) -> bytes | memoryview:
        """``payload`` itself (nothing copied), or copied into ``out``."""
        _check_length(payload, raw_length)
        if out is None:
            return payload
        out[:] = payload
        return out

    def decode_hashed(
        self, payload: memoryview, raw_length: int, out: memoryview | None, hasher: Any
    ) -> None:
        """Copy ``payload`` into ``out`` and hash what was copied, block by block
        (:func:`~ckstore.objects.codecs.base.hash_and_copy`)."""
        _check_length(payload, raw_length)
        hash_and_copy(payload, out, hasher)


def _check_length(payload: memoryview, raw_length: int) -> None:
    if len(payload) != raw_length:
        raise CorruptionError(f"raw chunk has {len(payload)} bytes, expected {raw_length}")


CODEC = NoneCodec()
