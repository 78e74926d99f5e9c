"""Payloads that arrive from another store, checked against their chunk id before they are kept.

A store checks its own payloads by the digests its writers recorded (``hashing.payload_digest``,
an unkeyed checksum that also covers the decoder). A payload read from *another* store (a pull,
a clone, a read of a chunk the local tier evicted, bringing it back) comes with that store's
row, digest included, and whoever controls that store controls both: a digest it supplies
proves nothing. So such a payload is decoded and hashed against the chunk's id (BLAKE3 of its
raw bytes), the one thing the other store cannot choose; a delta is decoded onto the verified
bytes of its base as *this* store holds them (the base the other store has may differ), and
hashed. Only then is it recorded here (docs/RELIABILITY.md, I7).

The decoded bytes are hashed as they are produced (``codecs.decode_hashed``) and never kept; a
delta's XOR bytes go through a per-thread buffer that is reused.
"""

from __future__ import annotations

import threading
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.codecs import decode, decode_hashed, is_delta
from ckstore.objects.delta import xor_into
from ckstore.objects.hashing import as_bytes_view, new_hasher
from ckstore.objects.memory import private_memory

_local = threading.local()


def _buffer(n: int) -> memoryview:
    buf = getattr(_local, "xor", None)
    if buf is None or len(buf) < n:
        buf = _local.xor = private_memory(max(n, 1 << 20))
    return memoryview(buf)[:n]


def matches_id(
    chunk_id: str, codec: str, payload: Any, raw_length: int, base: Any | None = None
) -> bool:
    """Whether ``payload`` decodes to bytes whose id is ``chunk_id``.

    Args:
        chunk_id: the id the payload is stored under.
        codec, payload, raw_length: the payload as stored, with its row's codec and raw length.
        base: for a delta codec, the verified raw bytes of its base (as this store holds
            them); None for a whole chunk.

    Returns:
        False for a payload that is malformed, a delta without a base (or a whole chunk with
        one), a base of another length, or bytes that hash to another id.
    """
    hasher = new_hasher()
    try:
        if base is None:
            if is_delta(codec):
                return False
            decode_hashed(codec, payload, raw_length, None, hasher)
        else:
            base_view = as_bytes_view(base)
            if not is_delta(codec) or len(base_view) != raw_length:
                return False
            out = _buffer(raw_length)
            decode(codec, payload, raw_length, out)  # the XOR bytes...
            xor_into(out, base_view)  # ...onto the base
            hasher.update(out)
    except (CorruptionError, InvalidInputError):
        return False
    return str(hasher.hexdigest()) == chunk_id
