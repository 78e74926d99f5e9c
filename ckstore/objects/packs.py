"""The pack format: many encoded chunks in one content-named, self-describing object.

Name: ``packs/<first 2 hex of pack_id>/<pack_id>.pack``, where ``pack_id`` is the lowercase hex
BLAKE3 of the header, trailer and footer bytes concatenated (see :func:`pack_id_of`): the
trailer commits to every chunk's id, so the payloads need not be hashed twice.

Layout (all integers little-endian, fixed width)::

    offset 0   header, 32 bytes
               8s  magic            b"CKPACK\\x00\\x01"
               u16 format version   1; 2 when the pack holds a delta; 3 when it holds an
                                    exp-zstd chunk (version 2's entries)
               u16 hash id          1 = blake3 (chunk ids and trailer checksum)
               u32 reserved         0
               16s writer nonce     random bytes: two writers never produce the same pack id,
                                    even for the same chunks, so each pack has one owner and GC
                                    can reason about it (a retried take never "finds" a crashed
                                    take's orphan pack while GC deletes it)
    offset 32  payloads: each chunk's encoded bytes, back to back, in the order added,
               no padding; every chunk is encoded on its own, so one ranged read of
               (offset, length) returns it
    T          trailer: one entry per chunk, in payload order, 64 bytes (version 1) or 96
               bytes (versions 2 and 3):
               32s chunk id (raw 32 bytes of the BLAKE3 of the chunk's raw bytes)
               u64 offset       of the payload from the start of the pack
               u64 length       of the payload in bytes
               u64 raw_length   of the decoded chunk in bytes
               u8  codec        0 = none, 1 = zstd, 2 = bytegroup-zstd, 3 = xor-zstd,
                                4 = xor-bytegroup-zstd (3 and 4 only from version 2),
                                5 = exp-zstd (only from version 3): each codec's
                                ``pack_id`` and ``pack_version`` (``codecs/``)
               7x  zero padding
               32s base id      versions 2 and 3: the chunk id of the base a delta (codec 3
                                or 4) is XORed against; 32 zero bytes for any other codec
    S - 56     footer, 56 bytes
               u64 trailer length (= entry size * count)
               u64 count        number of chunks
               32s BLAKE3 of the trailer bytes
               8s  end magic    b"CKPEND\\x00\\x01"

where ``S`` is the pack size and ``T = S - 56 - trailer length``. Rules a reader MUST check:
both magics, the version, ``trailer length == entry size * count``, the trailer checksum, every
payload inside ``[32, T)``, known codec ids, for codec none ``length == raw_length``, and that a
base id is present exactly for the delta codecs and differs from the chunk's own id. A writer
MUST NOT store one chunk id twice in a pack, and writes the lowest version that can hold its
chunks (so packs without deltas or exp-zstd chunks read the same with older readers, and an
older reader refuses a newer pack by its version, asking for an upgrade). Worked example: an empty pack is never written; a pack
holding the single raw chunk ``b"abc"`` (codec none) is 32 + 3 + 64 + 56 = 155 bytes, the
payload at offset 32.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.backend import Backend, ObjectWriter
from ckstore.objects.codecs import MAX_RAW_LENGTH, is_delta
from ckstore.objects.codecs.registry import REGISTERED
from ckstore.objects.hashing import as_bytes_view, is_chunk_id, new_hasher, payload_digest
from ckstore.objects.location import ChunkLocation

MAGIC = b"CKPACK\x00\x01"
END_MAGIC = b"CKPEND\x00\x01"
FORMAT_VERSION = 1
DELTA_FORMAT_VERSION = 2
"""The version of packs holding deltas (96-byte entries with a base id); every later version
has the same entries and only adds codecs (each codec names the first version that may hold
it, ``Codec.pack_version``: 3 for exp-zstd)."""
LATEST_FORMAT_VERSION = max(c.pack_version for c in REGISTERED)
"""The newest pack version this ckstore reads and writes."""
HASH_ID_BLAKE3 = 1
PACK_PREFIX = "packs/"

HEADER = struct.Struct("<8sHHI16s")
ENTRY = struct.Struct("<32sQQQB7x")
ENTRY_V2 = struct.Struct("<32sQQQB7x32s")
_ENTRIES = {FORMAT_VERSION: ENTRY} | {
    v: ENTRY_V2 for v in range(DELTA_FORMAT_VERSION, LATEST_FORMAT_VERSION + 1)
}
_NO_BASE = bytes(32)
FOOTER = struct.Struct("<QQ32s8s")
CODEC_IDS = {c.name: c.pack_id for c in REGISTERED}
"""Codec name -> id stored in the trailer (none 0, zstd 1, bytegroup-zstd 2, xor-zstd 3,
xor-bytegroup-zstd 4, exp-zstd 5)."""
_CODEC_NAMES = {i: name for name, i in CODEC_IDS.items()}
_FIRST_VERSION = {c.name: c.pack_version for c in REGISTERED}

MAX_ENTRIES = 1 << 24
"""Hard limit on chunks per pack (a corrupt count must not make a reader allocate wildly)."""

_TAIL_READ = 64 << 10


def pack_name(pack_id: str) -> str:
    """The object name of a pack: ``packs/<2 hex>/<pack_id>.pack``.

    Raises:
        InvalidInputError: ``pack_id`` is not a 64-hex id.
    """
    if not is_chunk_id(pack_id):
        raise InvalidInputError(f"not a pack id: {pack_id!r}")
    return f"{PACK_PREFIX}{pack_id[:2]}/{pack_id}.pack"


def pack_id_from_name(name: str) -> str | None:
    """The pack id in a pack object name, or None if ``name`` is not a pack name."""
    stem = name.rsplit("/", 1)[-1]
    if not name.startswith(PACK_PREFIX) or not stem.endswith(".pack"):
        return None
    pack_id = stem[: -len(".pack")]
    return pack_id if is_chunk_id(pack_id) and name == pack_name(pack_id) else None


class PackWriter:
    """Collects encoded chunks and writes them as one pack.

    Payloads go to a :meth:`Backend.writer` as they are added: straight into a temporary file on
    a local disk (so the writer holds no payload, and the caller may reuse its buffer at once:
    :attr:`holds_payloads` is False), or kept by reference until :meth:`finish` where the
    backend can only put whole objects. :meth:`finish` writes the trailer and footer, fills in
    the header (its version depends on the codecs added) and publishes the pack under its id, so
    the pack is durable when it returns.

    Args:
        backend: where the pack goes.
        target_size: size at which :attr:`full` turns true.
        direct: ask the backend to write around the page cache (:meth:`Backend.writer`).
    """

    def __init__(self, backend: Backend, target_size: int = 64 << 20, direct: bool = False) -> None:
        self._backend = backend
        self._target = target_size
        self._direct = direct
        self._out: ObjectWriter | None = None
        self._entries: list[tuple[str, int, int, int, str, str | None]] = []
        self._digests: list[str] = []
        self._ids: set[str] = set()
        self._offset = HEADER.size
        self._spent = False
        self._version = FORMAT_VERSION

    @property
    def holds_payloads(self) -> bool:
        """Whether added payloads stay referenced until :meth:`finish` (their buffers must not
        be reused before); False when they are written away as they are added."""
        return self._sink().holds_data

    @property
    def nbytes(self) -> int:
        """Size the pack would have if finished now."""
        return self._offset + self._entry.size * len(self._entries) + FOOTER.size

    @property
    def _entry(self) -> struct.Struct:
        return _ENTRIES[self._version]

    @property
    def count(self) -> int:
        """Number of distinct chunks added."""
        return len(self._entries)

    @property
    def full(self) -> bool:
        """Whether :attr:`nbytes` reached the target size."""
        return self.nbytes >= self._target

    def _sink(self) -> ObjectWriter:
        if self._out is None:
            self._out = self._backend.writer(self._direct)
            self._out.write(bytes(HEADER.size))  # filled in by finish(), once the version is known
        return self._out

    def add(
        self, chunk_id: str, codec: str, payload: Any, raw_length: int, base_id: str | None = None
    ) -> None:
        """Add one encoded chunk; a chunk id already in this pack is ignored.

        ``base_id`` names the base chunk of a delta (and only of a delta).

        Raises:
            InvalidInputError: bad id, unknown codec, negative length, a base id missing for a
                delta, given for another codec or equal to the chunk's id, or the writer is spent.
            StorageError: the payload could not be written (NoSpaceError: the disk is full).
        """
        if self._spent:
            raise InvalidInputError("PackWriter.add after finish(): the writer is spent")
        if not is_chunk_id(chunk_id):
            raise InvalidInputError(f"not a chunk id: {chunk_id!r}")
        if codec not in CODEC_IDS:
            raise InvalidInputError(f"unknown codec {codec!r}")
        view = as_bytes_view(payload)
        if raw_length < 0 or (codec == "none" and raw_length != len(view)):
            raise InvalidInputError(f"chunk {chunk_id}: bad raw_length {raw_length}")
        if is_delta(codec) != (base_id is not None) or base_id == chunk_id:
            raise InvalidInputError(f"chunk {chunk_id}: codec {codec!r} with base {base_id!r}")
        if base_id is not None and not is_chunk_id(base_id):
            raise InvalidInputError(f"chunk {chunk_id}: not a base chunk id: {base_id!r}")
        if chunk_id in self._ids:
            return
        if len(self._entries) >= MAX_ENTRIES:
            raise InvalidInputError(f"a pack holds at most {MAX_ENTRIES} chunks")
        self._sink().write(view)
        self._ids.add(chunk_id)
        self._version = max(self._version, _version_for(codec))
        self._entries.append((chunk_id, self._offset, len(view), raw_length, codec, base_id))
        self._digests.append(payload_digest(view, chunk_id, codec, raw_length, base_id))
        self._offset += len(view)

    def finish(self) -> tuple[str, int, list[ChunkLocation]] | None:
        """Write the pack durably; return ``(pack_id, pack_size, locations)``, or None if empty.

        After this call the writer is spent.
        """
        if self._spent:
            raise InvalidInputError("PackWriter.finish called twice: the writer is spent")
        self._spent = True
        if not self._entries:
            self.abort()
            return None
        out = self._sink()
        header, trailer, footer = self._frame()
        try:
            out.write(trailer)
            out.write(footer)
            out.patch(0, header)
            pack_id = pack_id_of(header, trailer, footer)
            out.commit(pack_name(pack_id))
        except BaseException:
            out.abort()
            raise
        locations = [
            ChunkLocation(cid, pack_id, off, length, raw, codec, base, payload_digest=digest)
            for (cid, off, length, raw, codec, base), digest in zip(self._entries, self._digests)
        ]
        return pack_id, self.nbytes, locations

    def abort(self) -> None:
        """Drop what was written (nothing becomes visible); the writer is spent."""
        self._spent = True
        if self._out is not None:
            self._out.abort()

    def _frame(self) -> tuple[bytes, bytes, bytes]:
        """The header, trailer and footer of the pack as added so far."""
        header = HEADER.pack(MAGIC, self._version, HASH_ID_BLAKE3, 0, os.urandom(16))
        if self._entry is ENTRY_V2:
            trailer = b"".join(
                ENTRY_V2.pack(
                    bytes.fromhex(cid),
                    off,
                    length,
                    raw,
                    CODEC_IDS[codec],
                    _NO_BASE if base is None else bytes.fromhex(base),
                )
                for cid, off, length, raw, codec, base in self._entries
            )
        else:
            trailer = b"".join(
                ENTRY.pack(bytes.fromhex(cid), off, length, raw, CODEC_IDS[codec])
                for cid, off, length, raw, codec, _ in self._entries
            )
        checksum = new_hasher().update(trailer).digest()
        footer = FOOTER.pack(len(trailer), len(self._entries), checksum, END_MAGIC)
        return header, trailer, footer


def _version_for(name: str) -> int:
    """The first pack version that may hold a chunk of codec ``name``."""
    return _FIRST_VERSION[name]


def pack_overhead(count: int, deltas: bool = False) -> int:
    """Bytes of a pack of ``count`` chunks that are not payload (header, trailer, footer)."""
    return HEADER.size + (ENTRY_V2 if deltas else ENTRY).size * count + FOOTER.size


@dataclass(frozen=True)
class PackIndex:
    """A pack's structure as read from the pack itself: the bytes its id is the hash of, and
    the chunk table its trailer holds (already checked: magics, version, checksum, ranges)."""

    pack_id: str
    size: int
    header: bytes
    trailer: bytes
    footer: bytes
    locations: list[ChunkLocation]

    @property
    def computed_id(self) -> str:
        """The id these bytes hash to; equal to :attr:`pack_id` unless the pack is damaged."""
        return pack_id_of(self.header, self.trailer, self.footer)

    @property
    def trailer_start(self) -> int:
        """Offset of the trailer: where the payloads must end."""
        return self.size - FOOTER.size - len(self.trailer)


def read_pack_index(backend: Backend, pack_id: str) -> list[ChunkLocation]:
    """Rebuild a pack's chunk table from the pack alone, with ranged reads only.

    Reads the last 64 KiB (or the whole pack if smaller), and the rest of the trailer in a
    second read only if it is longer. The pack's id is not checked (see :func:`load_pack_index`).

    Raises:
        ObjectNotFoundError: the pack does not exist.
        CorruptionError: bad magic, version, counts, checksum or entries.
    """
    return load_pack_index(backend, pack_id).locations


def load_pack_index(backend: Backend, pack_id: str) -> PackIndex:
    """Read and check a pack's header, trailer and footer (see :func:`read_pack_index`).

    Raises:
        ObjectNotFoundError: the pack does not exist.
        CorruptionError: bad magic, version, counts, checksum or entries.
    """
    name = pack_name(pack_id)
    size = backend.size(name)
    where = f"pack {pack_id} in store {backend.url}"
    if size < HEADER.size + FOOTER.size:
        raise CorruptionError(f"{where} is too small to be a pack ({size} bytes)")
    tail_start = max(0, size - _TAIL_READ)
    tail = backend.get(name, tail_start, size - tail_start)
    footer = bytes(tail[len(tail) - FOOTER.size :])
    trailer_len, count, checksum, end_magic = FOOTER.unpack(footer)
    if end_magic != END_MAGIC:
        raise CorruptionError(f"{where} has a bad end magic {end_magic!r}")
    if count > MAX_ENTRIES or trailer_len not in (count * ENTRY.size, count * ENTRY_V2.size):
        raise CorruptionError(f"{where} has a bad footer (count {count}, trailer {trailer_len})")
    trailer_start = size - FOOTER.size - trailer_len
    if trailer_start < HEADER.size:
        raise CorruptionError(f"{where} has a trailer longer than the pack")
    if trailer_start >= tail_start:
        trailer = bytes(tail[trailer_start - tail_start : len(tail) - FOOTER.size])
    else:
        trailer = backend.get(name, trailer_start, trailer_len)
    if new_hasher().update(trailer).digest() != checksum:
        raise CorruptionError(f"{where} has a trailer that fails its checksum")
    header = bytes(tail[: HEADER.size]) if tail_start == 0 else backend.get(name, 0, HEADER.size)
    version = _check_header(header, where)
    if trailer_len != count * _ENTRIES[version].size:
        raise CorruptionError(
            f"{where}: a version {version} pack with {count} entries of {trailer_len} bytes"
        )
    locations = _parse_entries(trailer, count, pack_id, trailer_start, where, version)
    return PackIndex(pack_id, size, header, trailer, footer, locations)


def _check_header(data: bytes, where: str) -> int:
    magic, version, hash_id, _, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptionError(f"{where} has a bad magic {magic!r}")
    if version not in _ENTRIES or hash_id != HASH_ID_BLAKE3:
        raise CorruptionError(
            f"{where} has unsupported version {version} / hash id {hash_id}: it was written by "
            "a newer ckstore; upgrade ckstore to read it"
        )
    return int(version)


def _parse_entries(
    trailer: bytes, count: int, pack_id: str, limit: int, where: str, version: int = FORMAT_VERSION
) -> list[ChunkLocation]:
    entry = _ENTRIES[version]
    locations = []
    for i in range(count):
        fields = entry.unpack_from(trailer, i * entry.size)
        raw_id, off, length, raw_len, codec_id = fields[:5]
        base_raw = fields[5] if len(fields) > 5 else _NO_BASE
        name = _CODEC_NAMES.get(codec_id)
        if name is None or _version_for(name) > version:
            raise CorruptionError(
                f"{where}: entry {i} has codec id {codec_id}, unknown in a version {version} pack"
            )
        base = None if base_raw == _NO_BASE else base_raw.hex()
        if is_delta(name) != (base is not None) or base_raw == raw_id:
            raise CorruptionError(f"{where}: entry {i} has codec {name} with base {base}")
        if off < HEADER.size or off + length > limit or (name == "none" and length != raw_len):
            raise CorruptionError(f"{where}: entry {i} has a bad range ({off}, {length})")
        if raw_len > MAX_RAW_LENGTH:
            raise CorruptionError(f"{where}: entry {i} has a raw length of {raw_len} bytes")
        locations.append(ChunkLocation(raw_id.hex(), pack_id, off, length, raw_len, name, base))
    return locations


def pack_id_of(header: Any, trailer: Any, footer: Any) -> str:
    """A pack's id: BLAKE3 of its header, trailer and footer bytes, in that order.

    The trailer lists every chunk's id (BLAKE3 of its raw bytes), place and codec, so the id
    commits to the whole content without hashing the payloads a second time (each payload is
    verified against its chunk id whenever it is read); the header's nonce makes it unique.
    """
    hasher = new_hasher()
    for part in (header, trailer, footer):
        hasher.update(part)
    return str(hasher.hexdigest())
