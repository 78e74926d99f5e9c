"""Packs and the object store: write, rebuild the index, verify every read."""

from __future__ import annotations

import numpy as np
import pytest

from ckstore.errors import CorruptionError, InvalidInputError, ObjectNotFoundError
from ckstore.objects import (
    Backend,
    ChunkLocation,
    CountingBackend,
    FaultyBackend,
    ObjectStore,
    PackWriter,
    chunk_id,
    encode,
    memory_backend,
    pack_name,
    read_pack_index,
    verify_pack,
)
from ckstore.objects.packs import ENTRY, FOOTER, HEADER, pack_id_of

RNG = np.random.default_rng(7)


def _chunks(n: int) -> list[bytes]:
    kinds = [  # per group of 3: ~3000 + ~20 + ~6900 stored bytes (codecs none, zstd, bytegroup)
        lambda: RNG.bytes(3000),
        lambda: bytes(5000),
        lambda: RNG.normal(0, 0.02, 2048).astype(np.float32).tobytes(),
    ]
    return [kinds[i % 3]() for i in range(n)]


def _write(store: ObjectStore, chunks: list[bytes], target: int) -> dict[str, list[ChunkLocation]]:
    packs: dict[str, list[ChunkLocation]] = {}
    writer = store.new_pack_writer(target)
    for raw in chunks:
        codec, payload = encode(raw, 4, len(raw) == 8192)
        writer.add(chunk_id(raw), codec, payload, len(raw))
        if writer.full:
            pack_id, size, locs = writer.finish()  # type: ignore[misc]
            assert store.pack_size(pack_id) == size
            packs[pack_id] = locs
            writer = store.new_pack_writer(target)
    result = writer.finish()
    if result:
        packs[result[0]] = result[2]
    return packs


def test_three_packs_round_trip(backend: Backend) -> None:
    store = ObjectStore(backend)
    chunks = _chunks(9)
    packs = _write(store, chunks, target=9_000)
    assert len(packs) == 3
    assert store.list_packs() == sorted(packs)
    by_id = {chunk_id(c): c for c in chunks}
    for pack_id, locs in packs.items():
        assert read_pack_index(backend, pack_id) == locs
        verify_pack(backend, pack_id)
        for loc in locs:
            assert bytes(store.read_chunk(loc)) == by_id[loc.chunk_id]
            out = memoryview(bytearray(loc.raw_length))
            assert store.read_chunk(loc, out) is out and bytes(out) == by_id[loc.chunk_id]
    codecs = {loc.codec for locs in packs.values() for loc in locs}
    assert codecs == {"none", "bytegroup-zstd", "zstd"}
    assert all(len(locs) == 3 for locs in packs.values())


def test_pack_layout_worked_example() -> None:
    backend = memory_backend()
    writer = PackWriter(backend)
    cid = chunk_id(b"abc")
    writer.add(cid, "none", b"abc", 3)
    writer.add(cid, "none", b"abc", 3)  # duplicate ignored
    assert writer.count == 1 and writer.nbytes == 155
    pack_id, size, locs = writer.finish()  # type: ignore[misc]
    assert size == 155 == HEADER.size + 3 + ENTRY.size + FOOTER.size
    assert locs == [ChunkLocation(cid, pack_id, 32, 3, 3, "none")]
    data = backend.get(pack_name(pack_id))
    assert data[:8] == b"CKPACK\x00\x01" and data[-8:] == b"CKPEND\x00\x01"
    assert data[32:35] == b"abc" and pack_id == pack_id_of(data[:32], data[35:-56], data[-56:])
    with pytest.raises(InvalidInputError):
        writer.add(cid, "none", b"abc", 3)


def test_two_writers_of_the_same_chunks_make_distinct_packs() -> None:
    backend = memory_backend()
    ids = set()
    for _ in range(2):
        writer = PackWriter(backend)
        writer.add(chunk_id(b"abc"), "none", b"abc", 3)
        ids.add(writer.finish()[0])  # type: ignore[index]
    assert len(ids) == 2  # the header nonce gives every pack one owner


def test_empty_writer_returns_none() -> None:
    assert PackWriter(memory_backend()).finish() is None


def test_writer_rejects_bad_input() -> None:
    writer = PackWriter(memory_backend())
    with pytest.raises(InvalidInputError):
        writer.add("xyz", "none", b"a", 1)
    with pytest.raises(InvalidInputError):
        writer.add(chunk_id(b"a"), "lz4", b"a", 1)
    with pytest.raises(InvalidInputError):
        writer.add(chunk_id(b"a"), "none", b"a", 2)


def test_read_chunk_is_one_exact_ranged_get() -> None:
    counting = CountingBackend(memory_backend())
    store = ObjectStore(counting)
    chunks = _chunks(6)
    packs = _write(store, chunks, target=1 << 30)
    ((pack_id, locs),) = packs.items()
    counting.reset()
    loc = locs[3]
    store.read_chunk(loc)
    assert counting.get_calls == 1 and counting.bytes_read == loc.length
    rec = counting.gets[0]
    assert (rec.name, rec.offset, rec.length) == (pack_name(pack_id), loc.offset, loc.length)
    assert counting.size_calls == 0


def test_write_is_one_put() -> None:
    counting = CountingBackend(memory_backend())
    _write(ObjectStore(counting), _chunks(5), target=1 << 30)
    assert counting.put_calls == 1 and counting.created == 1


def _flip(backend: Backend, name: str, pos: int) -> None:
    data = bytearray(backend.get(name))
    data[pos] ^= 0x01
    backend.delete(name)
    backend.put(name, bytes(data))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_flipped_payload_byte_is_caught(index: int) -> None:
    backend = memory_backend()
    store = ObjectStore(backend)
    ((pack_id, locs),) = _write(store, _chunks(3), target=1 << 30).items()
    loc = locs[index]
    _flip(backend, pack_name(pack_id), loc.offset + loc.length // 2)
    with pytest.raises(CorruptionError, match=loc.chunk_id) as info:
        store.read_chunk(loc)
    assert pack_id in str(info.value)
    with pytest.raises(CorruptionError):
        verify_pack(backend, pack_id)


def test_flipped_trailer_byte_is_caught() -> None:
    backend = memory_backend()
    store = ObjectStore(backend)
    ((pack_id, locs),) = _write(store, _chunks(3), target=1 << 30).items()
    size = store.pack_size(pack_id)
    trailer_start = size - FOOTER.size - ENTRY.size * len(locs)
    _flip(backend, pack_name(pack_id), trailer_start + ENTRY.size + 33)
    with pytest.raises(CorruptionError, match="checksum"):
        read_pack_index(backend, pack_id)


@pytest.mark.parametrize("pos", [-1, -20, -50])
def test_flipped_footer_byte_is_caught(pos: int) -> None:
    backend = memory_backend()
    ((pack_id, _),) = _write(ObjectStore(backend), _chunks(2), target=1 << 30).items()
    _flip(backend, pack_name(pack_id), backend.size(pack_name(pack_id)) + pos)
    with pytest.raises(CorruptionError):
        read_pack_index(backend, pack_id)


def test_large_trailer_needs_second_read() -> None:
    counting = CountingBackend(memory_backend())
    writer = PackWriter(counting)
    raws = [i.to_bytes(4, "little") for i in range(2000)]
    for raw in raws:
        writer.add(chunk_id(raw), "none", raw, 4)
    pack_id, _, locs = writer.finish()  # type: ignore[misc]
    counting.reset()
    assert read_pack_index(counting, pack_id) == locs
    assert counting.get_calls == 3  # tail, the rest of the trailer, the header


def test_faulty_backend_flip_and_truncate() -> None:
    inner = memory_backend()
    ((pack_id, locs),) = _write(ObjectStore(inner), _chunks(3), target=1 << 30).items()
    flipping = ObjectStore(FaultyBackend(inner, flip_byte_in="packs/*", flip_at=5))
    with pytest.raises(CorruptionError):
        flipping.read_chunk(locs[0])
    short = ObjectStore(FaultyBackend(inner, truncate_reads_of="packs/*"))
    with pytest.raises(CorruptionError):
        short.read_chunk(locs[1])


def test_missing_pack() -> None:
    store = ObjectStore(memory_backend())
    loc = ChunkLocation(chunk_id(b"x"), "a" * 64, 16, 1, 1, "none")
    with pytest.raises(ObjectNotFoundError):
        store.read_chunk(loc)
    with pytest.raises(ObjectNotFoundError):
        read_pack_index(store.backend, "a" * 64)


def test_blobs(backend: Backend) -> None:
    store = ObjectStore(backend)
    blob_id = store.put_blob("manifests", b'{"a": 1}')
    assert blob_id == chunk_id(b'{"a": 1}')
    assert store.put_blob("manifests", b'{"a": 1}') == blob_id
    assert store.get_blob("manifests", blob_id) == b'{"a": 1}'
    assert store.list_blobs("manifests") == [blob_id]
    assert store.list_packs() == []
    store.delete_blob("manifests", blob_id)
    store.delete_blob("manifests", blob_id)
    assert store.list_blobs("manifests") == []
    with pytest.raises(InvalidInputError):
        store.put_blob("../x", b"")
    with pytest.raises(InvalidInputError):
        store.get_blob("manifests", "nothex")


def test_corrupt_blob() -> None:
    backend = memory_backend()
    store = ObjectStore(backend)
    blob_id = store.put_blob("manifests", b"hello")
    name = f"manifests/{blob_id[:2]}/{blob_id}"
    backend.delete(name)
    backend.put(name, b"hellO")
    with pytest.raises(CorruptionError, match=blob_id):
        store.get_blob("manifests", blob_id)


def test_delete_pack(backend: Backend) -> None:
    store = ObjectStore(backend)
    packs = _write(store, _chunks(2), target=1 << 30)
    for pack_id in packs:
        store.delete_pack(pack_id)
        store.delete_pack(pack_id)
    assert store.list_packs() == []
