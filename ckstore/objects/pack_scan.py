"""Verify a whole pack: every byte of it read and checked against the names it is stored under.

A pack is sound when (a) its header, trailer and footer hash to its name (the pack id, see
``packs.pack_id_of``), (b) its payloads lie back to back from the end of the header to the start
of the trailer, with no gap or overlap, and (c) every payload decodes to bytes that hash to the
chunk id the trailer lists for it (a delta's XOR bytes applied to its base's raw bytes, which
the caller provides). (a) covers the header's nonce and reserved bytes, which no
chunk read touches; (b) leaves no byte of the pack unverified; (c) covers the payloads.

Payloads are read in windows of consecutive chunks (at most ``window`` bytes each, or one
chunk if larger), so a pack of any size is checked in bounded memory with few ranged reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckstore.errors import CorruptionError
from ckstore.objects.backend import Backend
from ckstore.objects.codecs import decode
from ckstore.objects.delta import xor_into
from ckstore.objects.hashing import chunk_id, payload_digest
from ckstore.objects.location import ChunkLocation
from ckstore.objects.packs import HEADER, PackIndex, load_pack_index, pack_name

WINDOW_BYTES = 64 << 20


@dataclass(frozen=True)
class PackProblem:
    """One thing wrong with a pack: ``kind`` is ``pack-id``, ``pack-layout``,
    ``corrupt-chunk`` or ``missing-base`` (a delta whose base cannot be read); ``object`` the
    pack or chunk id."""

    kind: str
    object: str
    message: str


@dataclass
class PackScan:
    """What :func:`scan_pack` read and found."""

    pack_id: str
    bytes_read: int = 0
    chunks_read: int = 0
    problems: list[PackProblem] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    """Each chunk's ``hashing.payload_digest`` as its payload lies in the pack (for checking
    the digests an index recorded)."""

    @property
    def ok(self) -> bool:
        return not self.problems


BaseReader = Callable[[ChunkLocation], Any]
"""Given a delta's location, its base's verified raw bytes; raises to report the base unreadable."""


def scan_pack(
    backend: Backend, pack_id: str, window: int = WINDOW_BYTES, bases: BaseReader | None = None
) -> PackScan:
    """Read a whole pack and check (a), (b) and (c) of the module docstring.

    ``bases`` reads the base of each delta; without it a pack holding deltas reports each as
    ``missing-base``.

    Returns:
        What was read and every problem found (the scan goes on past damaged chunks).

    Raises:
        ObjectNotFoundError: the pack does not exist.
        CorruptionError: its trailer or footer is unreadable (no chunk table to check against).
    """
    idx = load_pack_index(backend, pack_id)
    scan = PackScan(pack_id, bytes_read=len(idx.header) + len(idx.trailer) + len(idx.footer))
    where = f"pack {pack_id} in store {backend.url}"
    if idx.computed_id != pack_id:
        scan.problems.append(
            PackProblem(
                "pack-id",
                pack_id,
                f"{where} does not match its name: its header, trailer and footer hash to "
                f"{idx.computed_id} (a damaged header, e.g. its nonce, or a renamed pack)",
            )
        )
    _check_layout(idx, scan, where)
    name = pack_name(pack_id)
    for group in _windows(sorted(idx.locations, key=lambda l: l.offset), window):
        start, end = group[0].offset, group[-1].offset + group[-1].length
        data = backend.get(name, start, end - start)
        scan.bytes_read += len(data)
        for loc in group:
            payload = memoryview(data)[loc.offset - start : loc.offset - start + loc.length]
            scan.digests[loc.chunk_id] = payload_digest(
                payload, loc.chunk_id, loc.codec, loc.raw_length, loc.base_id
            )
            _check_chunk(loc, payload, scan, where, bases)
    return scan


def verify_pack(backend: Backend, pack_id: str, bases: BaseReader | None = None) -> None:
    """Read a whole pack; raise on the first thing wrong with it (see :func:`scan_pack`;
    ``bases`` reads the bases of its deltas, without which a delta is reported unreadable).

    Raises:
        ObjectNotFoundError: the pack does not exist.
        CorruptionError: the pack does not match its name, its payloads do not fill it, or a
            chunk does not match its id.
    """
    scan = scan_pack(backend, pack_id, bases=bases)
    if scan.problems:
        raise CorruptionError(scan.problems[0].message)


def _check_layout(idx: PackIndex, scan: PackScan, where: str) -> None:
    expected = HEADER.size
    for loc in sorted(idx.locations, key=lambda l: l.offset):
        if loc.offset != expected:
            what = "a gap" if loc.offset > expected else "an overlap"
            scan.problems.append(
                PackProblem(
                    "pack-layout",
                    idx.pack_id,
                    f"{where}: {what} before chunk {loc.chunk_id} at offset {loc.offset} "
                    f"(the previous payload ends at {expected})",
                )
            )
            return
        expected = loc.offset + loc.length
    if expected != idx.trailer_start:
        scan.problems.append(
            PackProblem(
                "pack-layout",
                idx.pack_id,
                f"{where}: the payloads end at {expected}, the trailer starts at {idx.trailer_start}",
            )
        )


def _check_chunk(
    loc: ChunkLocation, payload: memoryview, scan: PackScan, where: str, bases: BaseReader | None
) -> None:
    scan.chunks_read += 1
    base: Any = None
    if loc.base_id is not None:
        try:
            if bases is None:
                raise CorruptionError("no reader for bases was given")
            base = bases(loc)
        except Exception as exc:  # reported, and the scan goes on
            scan.problems.append(
                PackProblem(
                    "missing-base",
                    loc.chunk_id,
                    f"chunk {loc.chunk_id} in {where} is a delta against chunk {loc.base_id}, "
                    f"which cannot be read: {exc}",
                )
            )
            return
    try:
        raw: Any = decode(loc.codec, payload, loc.raw_length)
        if base is not None:
            if len(base) != loc.raw_length:
                raise CorruptionError(
                    f"its base {loc.base_id} has {len(base)} bytes, not {loc.raw_length}"
                )
            raw = bytearray(raw)
            xor_into(raw, base)
    except CorruptionError as exc:
        scan.problems.append(
            PackProblem(
                "corrupt-chunk",
                loc.chunk_id,
                f"chunk {loc.chunk_id} in {where} cannot be decoded: {exc}",
            )
        )
        return
    if chunk_id(raw) != loc.chunk_id:
        scan.problems.append(
            PackProblem(
                "corrupt-chunk",
                loc.chunk_id,
                f"chunk {loc.chunk_id} in {where} does not match its id: the stored bytes are corrupt",
            )
        )


def _windows(locs: list[ChunkLocation], window: int) -> Iterator[list[ChunkLocation]]:
    """Runs of chunks adjacent in the pack, each spanning at most ``window`` bytes (or one)."""
    group: list[ChunkLocation] = []
    for loc in locs:
        if group:
            end = group[-1].offset + group[-1].length
            if loc.offset != end or loc.offset + loc.length - group[0].offset > window:
                yield group
                group = []
        group.append(loc)
    if group:
        yield group
