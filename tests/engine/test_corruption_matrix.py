"""A corruption matrix: damage every region of a pack, the manifest and the index, one at a time.

For each damage the same two things must hold:

- a wrong byte never comes back as data: every ``read_object`` and a whole ``restore`` either
  return exactly what was taken or raise a ckstore error (never another exception);
- the damage is seen: ``check(read_data=True)`` reports a problem.

The store holds one snapshot whose chunks use all three codecs and sit in one pack. Regions:
every header byte (magic, version, hash id, reserved, each nonce byte), the first and last byte
of each chunk payload, every field of the first and last trailer entries and the id of every
entry, every footer byte, a pack cut short or extended; bytes of the manifest, the manifest cut
or extended; index rows with wrong offsets, lengths, raw lengths, codecs or pack, and missing
chunk, reference and pack rows.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.errors import CkstoreError
from ckstore.objects import packs as packfmt

EXPECTED = {
    "m/floats": torch.zeros(512),  # exp-zstd when fast, bytegroup-zstd (float planes) when dense
    "m/ints": torch.arange(512, dtype=torch.int64),  # raw when fast, zstd when dense
    "m/noise": torch.randint(
        0, 256, (2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    ),
    "m/bf": torch.randn(1024, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16),
}


CODECS = {"fast": {"none", "exp-zstd"}, "dense": {"none", "zstd", "bytegroup-zstd"}}
"""What one take's pack holds with each take codec: the matrix runs on a loose and a dense pack."""


@pytest.fixture(scope="module", params=sorted(CODECS))
def template(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "store"
    s = ckstore.open(
        path,
        chunk_bytes=1024,
        pack_bytes=1 << 20,
        inline_bytes=16,
        take_codec=request.param,
        create=True,
    )
    s.take(
        {"m": ckstore.StateDict({k.split("/")[1]: v.clone() for k, v in EXPECTED.items()}, step=3)},
        run="r",
        step=1,
    )
    s.close()
    return path


@pytest.fixture
def store(template, tmp_path) -> Iterator[ckstore.Store]:
    shutil.copytree(template, tmp_path / "store")
    s = ckstore.open(tmp_path / "store", create=False)
    (pack_id,) = s.repository.objects.list_packs()
    codecs = {loc.codec for loc in objects.read_pack_index(s.repository.objects.backend, pack_id)}
    assert codecs in CODECS.values(), codecs
    assert s.check(read_data=True).ok
    yield s
    s.close()


def _assert_seen_and_never_wrong(store: ckstore.Store, what: str) -> None:
    try:
        snap = store.get("r")
    except CkstoreError:
        snap = None
    if snap is not None:
        for key, want in EXPECTED.items():
            try:
                got = snap.read_object(key)
            except CkstoreError:
                continue
            assert torch.equal(got, want), f"{what}: {key} came back wrong"
        dest = {
            "m": ckstore.StateDict(
                {k.split("/")[1]: torch.zeros_like(v) for k, v in EXPECTED.items()}, step=0
            )
        }
        try:
            snap.restore(dest)
        except CkstoreError:
            assert all(not t.any() for k, t in dest["m"].items() if k != "step"), (
                f"{what}: restore touched"
            )
        else:
            assert all(torch.equal(dest["m"][k.split("/")[1]], v) for k, v in EXPECTED.items()), (
                what
            )
    report = store.check(read_data=True)
    assert not report.ok, f"{what}: check saw nothing"


@contextmanager
def _damaged_file(path: Path, change) -> Iterator[None]:
    original = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(change(bytearray(original)))
    try:
        yield
    finally:
        path.write_bytes(original)


def _flip(at: int):
    def change(data: bytearray) -> bytes:
        data[at] ^= 0x10
        return bytes(data)

    return change


def _pack(store) -> tuple[Path, packfmt.PackIndex]:
    (pack_id,) = store.repository.objects.list_packs()
    return Path(store.url) / objects.pack_name(pack_id), packfmt.load_pack_index(
        store.repository.objects.backend, pack_id
    )


def _pack_offsets(idx: packfmt.PackIndex) -> Iterator[tuple[str, int]]:
    for i in range(packfmt.HEADER.size):
        yield f"header byte {i}", i
    for loc in idx.locations:
        yield f"payload of {loc.codec} chunk {loc.chunk_id[:8]} (first byte)", loc.offset
        yield (
            f"payload of {loc.codec} chunk {loc.chunk_id[:8]} (last byte)",
            loc.offset + loc.length - 1,
        )
    e = packfmt.ENTRY.size
    fields = {"id": 0, "offset": 32, "length": 40, "raw_length": 48, "codec": 56, "padding": 60}
    for n in range(len(idx.locations)):
        names = fields if n in (0, len(idx.locations) - 1) else {"id": 0}
        for field, at in names.items():
            yield f"trailer entry {n} {field}", idx.trailer_start + n * e + at
    for i in range(packfmt.FOOTER.size):
        yield f"footer byte {i}", idx.size - packfmt.FOOTER.size + i


def test_every_region_of_a_pack(store):
    path, idx = _pack(store)
    cases = list(_pack_offsets(idx))
    assert len(cases) > 100
    for what, at in cases:
        with _damaged_file(path, _flip(at)):
            _assert_seen_and_never_wrong(store, what)


@pytest.mark.parametrize("change", ["cut 1", "cut 100", "extend 1", "empty"])
def test_a_pack_cut_short_or_extended(store, change):
    path, _ = _pack(store)
    how = {
        "cut 1": lambda d: bytes(d[:-1]),
        "cut 100": lambda d: bytes(d[:-100]),
        "extend 1": lambda d: bytes(d) + b"\x00",
        "empty": lambda d: b"",
    }[change]
    with _damaged_file(path, how):
        _assert_seen_and_never_wrong(store, change)


def test_every_part_of_the_manifest(store):
    (mid,) = store.repository.objects.list_blobs("manifests")
    path = Path(store.url) / objects.blob_name("manifests", mid)
    size = path.stat().st_size
    changes = {
        f"manifest byte {at}": _flip(at) for at in (0, 1, size // 3, size // 2, size - 2, size - 1)
    }
    changes |= {
        "manifest cut": lambda d: bytes(d[:-1]),
        "manifest extended": lambda d: bytes(d) + b" ",
        "manifest empty": lambda d: b"",
    }
    for what, change in changes.items():
        with _damaged_file(path, change):
            _assert_seen_and_never_wrong(store, what)


@contextmanager
def _index_changed(store, *statements: str) -> Iterator[None]:
    db = Path(store.url) / "index.sqlite"
    backup = Path(str(db) + ".orig")
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(db, backup)
    conn = sqlite3.connect(db)  # foreign keys off: damage does not ask for permission
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()
    try:
        yield
    finally:
        store.repository.reads.close()  # every connection of the handle, before the files go
        store.repository.index.close()
        for f in db.parent.glob("index.sqlite-*"):
            f.unlink()
        shutil.copy(backup, db)


def _index_cases(store) -> dict[str, list[str]]:
    _, idx = _pack(store)
    cases: dict[str, list[str]] = {}
    by_codec = {loc.codec: loc.chunk_id for loc in idx.locations}
    for codec, cid in sorted(by_codec.items()):
        where = f"WHERE id = '{cid}'"
        cases |= {
            f"{codec} chunk: offset + 1": [f'UPDATE chunks SET "offset" = "offset" + 1 {where}'],
            f"{codec} chunk: offset - 1": [f'UPDATE chunks SET "offset" = "offset" - 1 {where}'],
            f"{codec} chunk: offset past the end": [
                f'UPDATE chunks SET "offset" = {idx.size + 10} {where}'
            ],
            f"{codec} chunk: length + 1": [f"UPDATE chunks SET length = length + 1 {where}"],
            f"{codec} chunk: length - 1": [f"UPDATE chunks SET length = length - 1 {where}"],
            f"{codec} chunk: raw length + 1": [
                f"UPDATE chunks SET raw_length = raw_length + 1 {where}"
            ],
            f"{codec} chunk: raw length - 1": [
                f"UPDATE chunks SET raw_length = raw_length - 1 {where}"
            ],
            f"{codec} chunk: another pack": [f"UPDATE chunks SET pack_id = '{'e' * 64}' {where}"],
            f"{codec} chunk: row missing": [f"DELETE FROM chunks {where}"],
            f"{codec} chunk: reference missing": [
                f"DELETE FROM snapshot_chunks WHERE chunk_id = '{cid}'"
            ],
        }
        for other in ("none", "zstd", "bytegroup-zstd", "exp-zstd", "nonsense"):
            if other != codec:
                cases[f"{codec} chunk: codec {other}"] = [
                    f"UPDATE chunks SET codec = '{other}' {where}"
                ]
    cases["pack row missing"] = ["DELETE FROM packs"]
    other = next(c for c in sorted(by_codec) if c != "none")
    cases["chunk ids swapped"] = [
        f"UPDATE chunks SET id = 'swap' WHERE id = '{by_codec['none']}'",
        f"UPDATE chunks SET id = '{by_codec['none']}' WHERE id = '{by_codec[other]}'",
        f"UPDATE chunks SET id = '{by_codec[other]}' WHERE id = 'swap'",
    ]
    return cases


def test_every_kind_of_damaged_index_row(store):
    cases = _index_cases(store)
    assert len(cases) > 25
    for what, statements in cases.items():
        with _index_changed(store, *statements):
            reopened = ckstore.open(store.url, create=False)
            try:
                _assert_seen_and_never_wrong(reopened, what)
            finally:
                reopened.close()


def test_gc_never_deletes_a_pack_whose_row_was_lost(store):
    with _index_changed(store, "DELETE FROM packs"):
        reopened = ckstore.open(store.url, create=False)
        reopened.gc(grace_seconds=0)
        assert reopened.repository.objects.list_packs(), (
            "gc took a pack that chunk rows still name for an orphan"
        )
        assert torch.equal(reopened.get("r").read_object("m/ints"), EXPECTED["m/ints"])
        reopened.close()
