"""``check --read-data`` reads every pack whole; ``--read-data F`` reads that share, at least one.

A pack is sound when its header, trailer and footer hash to its name, its payloads fill it, and
every chunk in it hashes to its id. Before, only live chunks were re-hashed, so a flipped byte
in a pack's header nonce went unnoticed; and a fraction flipped a coin per pack, so
``--read-data 0.1`` could read nothing and still say ``ok: True``.
"""

from __future__ import annotations

import math
import shutil
import struct
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli, objects
from ckstore.objects import packs as packfmt


@pytest.fixture(scope="module")
def _template(tmp_path_factory):
    path = tmp_path_factory.mktemp("ten") / "s"
    s = ckstore.open(path, chunk_bytes=1024, pack_bytes=64 << 10, inline_bytes=64, create=True)
    for step in range(10):
        s.take({"m": ckstore.StateDict(w=torch.arange(1024.0) + 1024 * step)}, run="r", step=step)
    assert len(s.repository.objects.list_packs()) == 10
    s.close()
    return path


@pytest.fixture
def ten_packs(_template, tmp_path):
    """A local store whose 10 snapshots each wrote one pack of 4 chunks (a fresh copy)."""
    shutil.copytree(_template, tmp_path / "s")
    s = ckstore.open(tmp_path / "s", create=True)
    yield s
    s.close()


def _pack_file(store, pack_id) -> Path:
    return Path(store.url) / objects.pack_name(pack_id)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_header_nonce_is_reported(ten_packs):
    pack_id = ten_packs.repository.objects.list_packs()[3]
    nonce_at = packfmt.HEADER.size - 16  # the last 16 header bytes are the writer nonce
    _flip(_pack_file(ten_packs, pack_id), nonce_at + 5)
    for read_data in (True, False):  # the structure pass reads the header too
        report = ten_packs.check(read_data=read_data)
        assert not report.ok
        assert [(p.kind, p.object) for p in report.problems] == [("pack-id", pack_id)]
    # every chunk still verifies: a restore returns the right data
    assert torch.equal(ten_packs.get("r@3").read_object("m/w"), torch.arange(1024.0) + 3072)


def test_read_data_reads_every_pack_whole(ten_packs):
    report = ten_packs.check(read_data=True)
    sizes = [
        ten_packs.repository.objects.pack_size(p) for p in ten_packs.repository.objects.list_packs()
    ]
    assert report.ok and report.packs_read == report.packs == 10
    assert report.bytes_read == sum(sizes)
    assert report.chunks_read == report.chunks == 40


@pytest.mark.parametrize(
    "fraction, packs", [(0.1, 1), (0.01, 1), (0.25, 3), (0.5, 5), (1.0, 10), (0, 0)]
)
def test_a_fraction_reads_that_share_of_the_packs_and_at_least_one(ten_packs, fraction, packs):
    report = ten_packs.check(read_data=fraction)
    assert report.packs_read == packs == (math.ceil(fraction * 10) if fraction else 0)
    assert report.chunks_read == 4 * packs and (report.bytes_read > 0) == (packs > 0)
    assert report.ok


def test_a_fraction_finds_damage_in_the_packs_it_reads(ten_packs):
    for (
        pack_id
    ) in ten_packs.repository.objects.list_packs():  # damage one payload byte of every pack
        _flip(_pack_file(ten_packs, pack_id), packfmt.HEADER.size + 3)
    report = ten_packs.check(read_data=0.1)
    assert report.packs_read == 1 and not report.ok
    assert {p.kind for p in report.problems} == {"corrupt-chunk"}


def test_cli_prints_how_much_it_read(ten_packs, capsys):
    assert cli.main(["--store", ten_packs.url, "check", "--read-data", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "packs_read: 1\n" in out and "chunks_read: 4\n" in out and "ok: True" in out


def _raw_pack(parts: list[bytes], gap: bytes = b"") -> tuple[str, bytes]:
    """A pack of raw (codec none) chunks with ``gap`` bytes between the first two payloads."""
    header = packfmt.HEADER.pack(packfmt.MAGIC, 1, 1, 0, b"\x07" * 16)
    body, entries, off = b"", b"", packfmt.HEADER.size
    for i, raw in enumerate(parts):
        if i == 1:
            body, off = body + gap, off + len(gap)
        entries += packfmt.ENTRY.pack(
            bytes.fromhex(objects.chunk_id(raw)), off, len(raw), len(raw), 0
        )
        body, off = body + raw, off + len(raw)
    checksum = objects.hashing.new_hasher().update(entries).digest()
    footer = packfmt.FOOTER.pack(len(entries), len(parts), checksum, packfmt.END_MAGIC)
    return packfmt.pack_id_of(header, entries, footer), header + body + entries + footer


def test_scan_pack_reports_bytes_that_no_chunk_covers():
    backend = objects.memory_backend()
    pack_id, data = _raw_pack([b"abc", b"defg"], gap=b"XYZ")
    backend.put(objects.pack_name(pack_id), data)
    scan = objects.scan_pack(backend, pack_id)
    assert [p.kind for p in scan.problems] == ["pack-layout"] and "gap" in scan.problems[0].message
    assert scan.chunks_read == 2 and scan.bytes_read == len(data) - 3
    good_id, good = _raw_pack([b"abc", b"defg"])
    backend.put(objects.pack_name(good_id), good)
    clean = objects.scan_pack(backend, good_id, window=4)  # windows of one chunk each
    assert clean.ok and clean.bytes_read == len(good) and clean.chunks_read == 2


def test_scan_pack_reports_every_damaged_chunk_and_goes_on():
    backend = objects.memory_backend()
    pack_id, data = _raw_pack([b"abc", b"defg", b"hij"])
    buf = bytearray(data)
    buf[packfmt.HEADER.size] ^= 1  # first chunk
    buf[packfmt.HEADER.size + 8] ^= 1  # third chunk
    backend.put(objects.pack_name(pack_id), bytes(buf))
    scan = objects.scan_pack(backend, pack_id)
    assert [p.kind for p in scan.problems] == ["corrupt-chunk", "corrupt-chunk"]
    assert scan.chunks_read == 3
    with pytest.raises(ckstore.CorruptionError):
        objects.verify_pack(backend, pack_id)


def test_struct_layout_matches_the_documented_header():
    assert packfmt.HEADER.size == 32 and struct.calcsize("<8sHHI") == 16  # nonce = last 16 bytes
