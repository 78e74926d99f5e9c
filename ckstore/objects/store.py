"""The object store facade: packs of chunks plus content-named blobs, every read verified.

Layout of a store's namespace::

    packs/<2 hex>/<pack_id>.pack     packs (see ``packs.py``)
    <kind>/<2 hex>/<blob_id>         blobs, e.g. kind "manifests"; blob_id = BLAKE3 of the bytes
"""

from __future__ import annotations

import mmap
import re
import threading
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.backend import Backend
from ckstore.objects.codecs import decode_hashed
from ckstore.objects.hashing import chunk_id, fingerprint, is_chunk_id, new_hasher
from ckstore.objects.packs import (
    PACK_PREFIX,
    ChunkLocation,
    PackWriter,
    pack_id_from_name,
    pack_name,
)

_local = threading.local()

_KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")


def _check_kind(kind: str) -> str:
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind) or kind == "packs":
        raise InvalidInputError(
            f"blob kind must match [a-z][a-z0-9_-]* and not be 'packs', got {kind!r}"
        )
    return kind


def blob_name(kind: str, blob_id: str) -> str:
    """The object name of a blob: ``<kind>/<2 hex>/<blob_id>``."""
    if not is_chunk_id(blob_id):
        raise InvalidInputError(f"not a blob id: {blob_id!r}")
    return f"{_check_kind(kind)}/{blob_id[:2]}/{blob_id}"


class ObjectStore:
    """What the upper layers use to write and read chunks and blobs.

    Every read is re-hashed against its id; a mismatch raises :class:`CorruptionError` and
    wrong bytes are never returned.

    Args:
        backend: the storage backend.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def backend(self) -> Backend:
        """The storage backend."""
        return self._backend

    def new_pack_writer(self, target_size: int = 64 << 20) -> PackWriter:
        """A writer for one new pack."""
        return PackWriter(self._backend, target_size)

    def read_chunk(self, loc: ChunkLocation, out: memoryview | None = None) -> bytes | memoryview:
        """Read, decode and verify one chunk with ONE ranged get of ``(offset, length)``.

        Args:
            loc: where the chunk is.
            out: optional writable buffer of exactly ``loc.raw_length`` bytes to decode into.

        Returns:
            The chunk's raw bytes (``out`` itself when given).

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload is malformed or does not hash to ``loc.chunk_id``.
        """
        target = out if out is not None else memoryview(bytearray(loc.raw_length))
        self.verify_chunk(loc, target)
        return target

    def verify_chunk(self, loc: ChunkLocation, out: memoryview | None = None, *, fingerprint_it: bool = False) -> int | None:
        """Read one chunk's payload, decode it and verify it against its id, in one pass.

        The payload is read into this thread's recycled buffer (``Backend.get_into``), decoded
        into ``out`` (or, when None, kept nowhere: a verify-only pass) and hashed block by
        block as it is decoded (``codecs.decode_hashed``).

        Returns:
            With ``fingerprint_it``, the payload's fingerprint (``hashing.fingerprint``) for
            :meth:`load_verified`; else None.

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload is malformed or does not hash to ``loc.chunk_id``.
        """
        payload = self._payload(loc)
        hasher = new_hasher()
        self._decode(loc, payload, out, hasher)
        if str(hasher.hexdigest()) != loc.chunk_id:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                "does not match its id: the stored bytes are corrupt"
            )
        return fingerprint(payload) if fingerprint_it else None

    def load_verified(self, loc: ChunkLocation, out: memoryview, expected: int) -> None:
        """Read a chunk that :meth:`verify_chunk` verified moments ago and decode it into ``out``.

        Instead of hashing the decoded bytes again, the payload is checked against the
        fingerprint ``verify_chunk`` returned: stored objects are immutable, so the payload
        that decoded to verified bytes then decodes to the same bytes now, and the check
        catches the one case left, the object having changed in between anyway.

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload differs from the one verified, or is malformed.
        """
        payload = self._payload(loc)
        if fingerprint(payload) != expected:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                "changed after it was verified: stored objects must never change"
            )
        self._decode(loc, payload, out, None)

    def _payload(self, loc: ChunkLocation) -> memoryview:
        """The chunk's stored payload, read into this thread's recycled buffer."""
        buf: mmap.mmap | None = getattr(_local, "payload", None)
        if buf is None or len(buf) < loc.length:
            # An anonymous mapping, not the heap: its memory goes back to the system with the
            # thread (a freed heap block of this size stays in the process).
            buf = _local.payload = mmap.mmap(-1, max(loc.length, 1 << 20))
        view = memoryview(buf)[: loc.length]
        self._backend.get_into(pack_name(loc.pack_id), loc.offset, view)
        return view

    def _decode(self, loc: ChunkLocation, payload: memoryview, out: memoryview | None, hasher: Any) -> None:
        try:
            decode_hashed(loc.codec, payload, loc.raw_length, out, hasher)
        except CorruptionError as exc:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                f"cannot be decoded: {exc}"
            ) from exc

    def put_blob(self, kind: str, data: Any) -> str:
        """Store ``data`` as a content-named blob of ``kind``; return its id."""
        blob_id = chunk_id(data)
        self._backend.put(blob_name(kind, blob_id), data)
        return blob_id

    def get_blob(self, kind: str, blob_id: str) -> bytes:
        """Read a blob and verify it hashes to ``blob_id``.

        Raises:
            ObjectNotFoundError: no such blob.
            CorruptionError: the stored bytes do not match the id.
        """
        data = self._backend.get(blob_name(kind, blob_id))
        if chunk_id(data) != blob_id:
            raise CorruptionError(
                f"{kind} blob {blob_id} in store {self._backend.url} does not match its id"
            )
        return data

    def list_blobs(self, kind: str) -> list[str]:
        """Ids of every blob of ``kind``, sorted."""
        prefix = f"{_check_kind(kind)}/"
        ids = (name.rsplit("/", 1)[-1] for name in self._backend.list(prefix))
        return sorted(i for i in ids if is_chunk_id(i))

    def delete_blob(self, kind: str, blob_id: str) -> None:
        """Delete a blob (idempotent)."""
        self._backend.delete(blob_name(kind, blob_id))

    def list_packs(self) -> list[str]:
        """Ids of every pack, sorted."""
        ids = (pack_id_from_name(name) for name in self._backend.list(PACK_PREFIX))
        return sorted(i for i in ids if i is not None)

    def pack_size(self, pack_id: str) -> int:
        """Size of a pack in bytes."""
        return self._backend.size(pack_name(pack_id))

    def delete_pack(self, pack_id: str) -> None:
        """Delete a pack (idempotent)."""
        self._backend.delete(pack_name(pack_id))

    def close(self) -> None:
        """Close the backend."""
        self._backend.close()
