"""The object store facade: packs of chunks plus content-named blobs, every read verified
(chunks through :mod:`ckstore.objects.chunk_reader`).

Layout of a store's namespace::

    packs/<2 hex>/<pack_id>.pack     packs (see ``packs.py``)
    <kind>/<2 hex>/<blob_id>         blobs, e.g. kind "manifests"; blob_id = BLAKE3 of the bytes
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError, ObjectNotFoundError
from ckstore.objects.backend import Backend
from ckstore.objects.chunk_reader import ChunkReader
from ckstore.objects.hashing import chunk_id, is_chunk_id
from ckstore.objects.location import ChunkLocation
from ckstore.objects.packs import PACK_PREFIX, PackWriter, pack_id_from_name, pack_name
from ckstore.objects.payloads import Kept

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

    Every read is verified (a chunk against its check or its id, a blob against its id); a
    mismatch raises :class:`CorruptionError` and wrong bytes are never returned. Chunks are read by a :class:`ChunkReader`, whose verbs
    this store offers as its own.

    Args:
        backend: the storage backend.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._reader = ChunkReader(backend)

    @property
    def backend(self) -> Backend:
        """The storage backend."""
        return self._backend

    def new_pack_writer(self, target_size: int = 64 << 20, direct: bool = False) -> PackWriter:
        """A writer for one new pack (``direct``: around the page cache, where the backend can:
        :meth:`Backend.writer`)."""
        return PackWriter(self._backend, target_size, direct)

    def read_chunk(
        self,
        loc: ChunkLocation,
        out: memoryview | None = None,
        *,
        trust: bool = False,
        check: str | None = None,
    ) -> bytes | memoryview:
        """Read, decode and verify one chunk (:meth:`ChunkReader.read_chunk`)."""
        return self._reader.read_chunk(loc, out, trust=trust, check=check)

    def verify_chunk(
        self,
        loc: ChunkLocation,
        out: memoryview | None = None,
        *,
        fingerprint_it: bool = False,
        trust: bool = False,
        check: str | None = None,
        keep: Kept | None = None,
    ) -> int | None:
        """Read one chunk's payload, decode it and verify it against its check or id, in one
        pass (:meth:`ChunkReader.verify_chunk`)."""
        return self._reader.verify_chunk(
            loc,
            out,
            fingerprint_it=fingerprint_it,
            trust=trust,
            check=check,
            keep=keep,
        )

    def load_kept(
        self,
        loc: ChunkLocation,
        kept: Kept,
        out: memoryview,
        *,
        verify_id: bool = False,
        check: str | None = None,
    ) -> None:
        """Decode a chunk from the payload views a verifying read kept, fetching nothing,
        checked as it lands (:meth:`ChunkReader.load_kept`)."""
        self._reader.load_kept(loc, kept, out, verify_id=verify_id, check=check)

    def drop(self, loc: ChunkLocation) -> None:
        """A hint: ``loc``'s payloads will not be touched for a while (:meth:`ChunkReader.drop`)."""
        self._reader.drop(loc)

    def prefetch(self, loc: ChunkLocation) -> None:
        """A hint: ``loc``'s payloads will be read soon (:meth:`ChunkReader.prefetch`)."""
        self._reader.prefetch(loc)

    def load_verified(
        self, loc: ChunkLocation, out: memoryview, expected: int, check: str | None
    ) -> None:
        """Decode a chunk verified moments ago into ``out``, its payload checked against the
        fingerprint the verification returned and the bytes decoded against ``check``
        (:meth:`ChunkReader.load_verified`)."""
        self._reader.load_verified(loc, out, expected, check)

    def load_digested(self, loc: ChunkLocation, out: memoryview) -> None:
        """Decode a chunk whose payloads were compared with their digests into ``out``, each
        compared again, hashed against the id as it lands (:meth:`ChunkReader.load_digested`)."""
        self._reader.load_digested(loc, out)

    def check_payloads(self, loc: ChunkLocation, keep: Kept | None = None) -> None:
        """Compare the stored payloads of a chunk and its chain with their recorded digests,
        undecoded (:meth:`ChunkReader.check_payloads`)."""
        self._reader.check_payloads(loc, keep)

    def trust(self, chunk_id: str, payload: Any) -> None:
        """Remember that ``payload`` is a right encoding of chunk ``chunk_id``
        (:meth:`ChunkReader.trust`)."""
        self._reader.trust(chunk_id, payload)

    def trusted_planes(self, loc: ChunkLocation, itemsize: int) -> Any:
        """The byte planes of a chunk whose every payload this process trusts, else None
        (:meth:`ChunkReader.trusted_planes`)."""
        return self._reader.trusted_planes(loc, itemsize)

    def put_blob(self, kind: str, data: Any) -> str:
        """Store ``data`` as a content-named blob of ``kind``; return its id."""
        return self.store_blob(kind, data)[0]

    def store_blob(self, kind: str, data: Any) -> tuple[str, bool]:
        """Store ``data`` as a content-named blob of ``kind``; its id, and whether this call
        wrote it (False: a blob of that name was there already, and was kept as it is).

        A blob found there is not this writer's: a gc may be deleting it (a manifest no
        snapshot names any more, or an orphan of a writer that died), and nothing the writer
        holds stops that. So a caller that goes on to commit a record naming a blob it did not
        write calls :meth:`put_blob_back` after its commit (gc does its part, after deleting:
        ``history.gc``), and one of the two always sees the other.
        """
        blob_id = chunk_id(data)
        return blob_id, self._backend.put(blob_name(kind, blob_id), data)

    def put_blob_back(self, kind: str, data: Any) -> bool:
        """Put a content-named blob of ``kind`` back if it is gone (see :meth:`store_blob`);
        whether it was."""
        name = blob_name(kind, chunk_id(data))
        return not self._backend.exists(name) and self._backend.put(name, data)

    def blob_bytes(self, kind: str, blob_id: str) -> bytes | None:
        """A blob's stored bytes as they are (not checked against its id); None if it is gone."""
        try:
            return self._backend.get(blob_name(kind, blob_id))
        except ObjectNotFoundError:
            return None

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

    def partial_uploads(self) -> Sequence[tuple[str, str]]:
        """Unfinished writes the backend holds (see :meth:`Backend.partial_uploads`)."""
        return self._backend.partial_uploads()

    def discard_upload(self, name: str, upload_id: str) -> None:
        """Discard one unfinished write (see :meth:`Backend.discard_upload`)."""
        self._backend.discard_upload(name, upload_id)

    def close(self) -> None:
        """Close the backend."""
        self._backend.close()
