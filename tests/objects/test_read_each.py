"""``Backend.get_into_each``: a read into place whose pieces are handed over as they land (the
check of a raw chunk read into its destination, while its bytes are still in the CPU's cache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckstore.errors import CorruptionError, ObjectNotFoundError
from ckstore.objects import Backend, LocalBackend, memory_backend
from ckstore.objects import local as local_mod

NAME = "packs/ab/" + "ab" * 32 + ".pack"


def _pieces(backend: Backend, offset: int, n: int) -> tuple[bytearray, list[bytes]]:
    out = bytearray(n)
    seen: list[bytes] = []
    backend.get_into_each(NAME, offset, memoryview(out), lambda p: seen.append(bytes(p)))
    return out, seen


@pytest.mark.parametrize("n", [1, local_mod.EACH_BYTES, 3 * local_mod.EACH_BYTES + 17])
def test_the_local_backend_hands_over_the_whole_read_in_order_in_pieces(
    tmp_path: Path, n: int
) -> None:
    data = os.urandom(n + 1000)
    backend = LocalBackend(tmp_path)
    backend.put(NAME, data)
    out, seen = _pieces(backend, 1000, n)
    assert bytes(out) == data[1000:]
    assert b"".join(seen) == data[1000:]
    assert all(0 < len(p) <= local_mod.EACH_BYTES for p in seen)
    assert len(seen) == -(-n // local_mod.EACH_BYTES)


def test_a_backend_without_pieces_hands_over_the_read_once() -> None:
    backend = memory_backend()
    data = os.urandom(5000)
    backend.put(NAME, data)
    out, seen = _pieces(backend, 7, 4000)
    assert bytes(out) == data[7:4007] and seen == [data[7:4007]]


def test_nothing_past_a_read_that_ends_early_is_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_mod, "EACH_BYTES", 4096)
    backend = LocalBackend(tmp_path)
    data = os.urandom(3 * 4096 + 100)
    backend.put(NAME, data)
    seen: list[bytes] = []
    with pytest.raises(CorruptionError):  # the pack ends in the fourth piece
        backend.get_into_each(NAME, 0, memoryview(bytearray(4 * 4096)), seen.append)
    assert b"".join(bytes(p) for p in seen) == data[: 3 * 4096]
    with pytest.raises(ObjectNotFoundError):
        backend.get_into_each(
            "packs/cd/" + "cd" * 32 + ".pack", 0, memoryview(bytearray(8)), seen.append
        )


@pytest.mark.parametrize("where", ["first piece", "last piece"])
def test_a_raw_chunk_read_into_place_in_pieces_is_checked_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import torch

    import ckstore
    from ckstore.objects.packs import pack_name

    monkeypatch.setattr(local_mod, "EACH_BYTES", 4096)
    g = torch.Generator().manual_seed(5)
    want = {"w": torch.randn(64, 256, generator=g)}  # 64 KiB: one raw chunk, 16 pieces
    store = ckstore.open(tmp_path / "s", create=True, chunk_bytes=1 << 20)
    snap = store.take({"m": ckstore.StateDict(want)}, run="r")
    index = store.repository.index
    (loc,) = index.chunk_locations(index.snapshot_chunk_ids(snap.id)).values()
    assert loc.codec == "none" and loc.length == 64 * 256 * 4

    dest = {"w": torch.zeros(64, 256)}
    store.get(snap.id).restore({"m": ckstore.StateDict(dest)}, atomic=False)
    assert torch.equal(dest["w"], want["w"])

    at = loc.offset + (10 if where == "first piece" else loc.length - 10)
    with open(tmp_path / "s" / pack_name(loc.pack_id), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptionError, match=loc.chunk_id):
        store.get(snap.id).restore({"m": ckstore.StateDict(dest)}, atomic=False)
    store.close()
