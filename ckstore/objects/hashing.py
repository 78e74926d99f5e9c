"""Chunk and object ids: lowercase hex BLAKE3 of the raw (uncompressed) bytes; and the fast
check every read verifies instead (:func:`raw_check`, docs/RELIABILITY.md I3).

The algorithm is named by :data:`HASH_NAME` so it can be recorded in the store's format info.
Example (a test vector): the id of ``b""`` is
``af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import blake3
import xxhash

HASH_NAME = "blake3"
"""Name of the id hash, as recorded in the format."""

ID_HEX_LENGTH = 64
"""Length of an id in hex characters (32 bytes)."""


_ID_RE = re.compile(r"[0-9a-f]{64}")


def new_hasher() -> Any:
    """A fresh incremental BLAKE3 hasher (single-threaded).

    Callers hash many chunks from a thread pool; BLAKE3's own threads on top of that only
    fight the pool for the same cores (measured: slower on 2 cores).
    """
    return blake3.blake3()


def as_bytes_view(data: Any) -> memoryview:
    """A flat unsigned-byte memoryview over ``data`` (a copy only if it is not contiguous)."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def chunk_id(data: Any) -> str:
    """The id of ``data``: lowercase hex BLAKE3 (64 characters).

    Args:
        data: bytes, bytearray, memoryview or any object exporting a contiguous buffer;
            read in place, never copied.

    Returns:
        The 64-character hex id.
    """
    view = as_bytes_view(data)
    hasher = new_hasher()
    hasher.update(view)
    return str(hasher.hexdigest())


def is_chunk_id(s: object) -> bool:
    """Whether ``s`` is a well-formed id (64 lowercase hex characters)."""
    return isinstance(s, str) and _ID_RE.fullmatch(s) is not None


_FINGERPRINT_SEED = int.from_bytes(os.urandom(8), "little")


def fingerprint(data: Any) -> int:
    """A fast 64-bit fingerprint of ``data`` (XXH3-64, seeded at random once per process).

    Not an id and never stored: a restore records it for a payload whose decoded bytes it has
    just verified against their BLAKE3 id, and checks it when it reads the same immutable
    payload again to show the bytes did not change in between (docs/RELIABILITY.md, I3). The
    random seed keeps stored bytes from being crafted to collide with a fingerprint nobody
    outside this process can compute.
    """
    return int(xxhash.xxh3_64_intdigest(as_bytes_view(data), seed=_FINGERPRINT_SEED))


def payload_digest(
    payload: Any, chunk_id: str, codec: str, raw_length: int, base_id: str | None = None
) -> str:
    """The digest of a stored chunk: lowercase hex XXH3-128, unseeded (32 characters), of the
    payload followed by what decoding it depends on: the chunk id (32 bytes), the raw length
    (8 bytes, little-endian), the codec name (UTF-8) and, for a delta, the base's id (32 bytes).

    Recorded in the index when a chunk is written, so a reader can show that the payload it
    reads, and the index row it decodes it with, are the ones the writer stored, without
    decoding it (the atomic restore's first pass, docs/RELIABILITY.md I3). It detects damage,
    not forgery: the chunk id (BLAKE3 of the raw bytes) stays the check every decoded byte
    passes.
    """
    h = xxhash.xxh3_128()
    h.update(as_bytes_view(payload))
    h.update(bytes.fromhex(chunk_id) + raw_length.to_bytes(8, "little") + codec.encode())
    if base_id is not None:
        h.update(bytes.fromhex(base_id))
    return str(h.hexdigest())


CHECK_NAME = "xxh3-64"
"""Name of the fast check a manifest records beside each chunk id (FORMAT.md section 7.3)."""


def check_seed(chunk_id: str) -> int:
    """The seed of a chunk's check: the first 8 bytes of its id, little-endian. Seeding with
    the id binds the check to the chunk: bytes of another chunk (a damaged index row, a read
    at the wrong place) fail it even where they carry that chunk's own check."""
    return int.from_bytes(bytes.fromhex(chunk_id[:16]), "little")


def new_checker(chunk_id: str) -> Any:
    """An incremental XXH3-64 seeded for ``chunk_id`` (:func:`check_seed`), with
    ``update(buffer)`` and ``hexdigest()``: fed a chunk's raw bytes in order, its hexdigest is
    the chunk's :func:`raw_check`. Large updates release the GIL.

    Raises:
        ValueError: ``chunk_id`` is not hex.
    """
    return xxhash.xxh3_64(seed=check_seed(chunk_id))


def raw_check(data: Any, chunk_id: str) -> str:
    """The fast check of a chunk: XXH3-64 of its raw bytes seeded with its id (16 lowercase hex
    digits). Computed at take from the same bytes as the id and recorded in the manifest beside
    it, so every read can check what it decoded at tens of GB/s where re-hashing with BLAKE3
    runs at a few: it covers the stored bytes and the decoder alike (a payload damaged at rest
    and a decoder that errs both change the decoded bytes). It detects damage, not forgery:
    bytes crossing a trust boundary are checked against the id (docs/RELIABILITY.md, I3).

    Raises:
        ValueError: ``chunk_id`` is not hex.
    """
    return str(xxhash.xxh3_64_hexdigest(as_bytes_view(data), seed=check_seed(chunk_id)))


def is_raw_check(s: object) -> bool:
    """Whether ``s`` is a well-formed check (16 lowercase hex digits)."""
    return isinstance(s, str) and _CHECK_RE.fullmatch(s) is not None


_CHECK_RE = re.compile(r"[0-9a-f]{16}")


def is_payload_digest(s: object) -> bool:
    """Whether ``s`` is a well-formed payload digest (32 lowercase hex characters)."""
    return isinstance(s, str) and _DIGEST_RE.fullmatch(s) is not None


_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
