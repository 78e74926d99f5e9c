"""Two levels of verification (docs/RELIABILITY.md, I3): every read checks each chunk's fast
check (XXH3-64 of its raw bytes, recorded in the manifest beside its id), which covers the
stored bytes and the decoder; BLAKE3 against the id runs where asked (``verify="full"``) and
for chunks whose manifest records no check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.format.manifest import TensorEntry
from ckstore.objects import into_place
from ckstore.objects.codecs import registry

KNOBS = {"chunk_bytes": 4 << 10, "pack_bytes": 64 << 10, "inline_bytes": 64}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 64, generator=g) * 0.02,
        "h": torch.randn(4096, generator=g).to(torch.bfloat16),
        "ids": torch.arange(3000, dtype=torch.int64),
    }


@pytest.fixture(params=["fast", "dense", "raw"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    s = ckstore.open(tmp_path / "s", take_codec=request.param, create=True, **KNOBS)
    s.take({"m": ckstore.StateDict(_state())}, run="r")
    yield s
    s.close()


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


def _restored(store: ckstore.Store, **kw: Any) -> dict[str, torch.Tensor]:
    dest = _zeros()
    store.get("r").restore({"m": ckstore.StateDict(dest)}, **kw)
    return dest


def test_a_take_records_the_check_of_every_chunk_beside_its_id(store: ckstore.Store) -> None:
    snap = store.get("r")
    refs = [
        (key, c)
        for key, e in snap.manifest.entries.items()
        if isinstance(e, TensorEntry)
        for c in e.chunks
    ]
    assert len(refs) > 10
    index = store.repository.index
    for key, ref in refs:
        locs = index.chunk_locations([ref.id])
        from ckstore.engine.locations import to_location

        raw = store.repository.objects.read_chunk(to_location(locs[ref.id], locs))
        assert ref.check == objects.raw_check(raw, ref.id), key


def _count_blake3(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = into_place.new_hasher

    def counted() -> Any:
        calls[0] += 1
        return real()

    monkeypatch.setattr(into_place, "new_hasher", counted)
    return calls


@pytest.mark.parametrize("atomic", [True, False])
def test_a_restore_checks_every_chunk_without_blake3_unless_asked(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    calls = _count_blake3(monkeypatch)
    dest = _restored(store, atomic=atomic, memory_budget=0)
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    assert store.get("r").read_object("m/w").equal(_state()["w"])
    assert calls[0] == 0
    dest = _restored(store, atomic=atomic, verify="full")
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    assert calls[0] >= len(store.get("r").manifest.chunk_ids())


def test_verify_takes_false_true_or_full(store: ckstore.Store) -> None:
    with pytest.raises(ckstore.InvalidInputError, match="'full'"):
        _restored(store, verify="fast")
    dest = _restored(store, verify=True)
    assert all(torch.equal(dest[k], v) for k, v in _state().items())


def _faulty_decoders(monkeypatch: pytest.MonkeyPatch, names: set[str]) -> list[int]:
    """Make every codec in ``names`` decode one bit wrong (and hash what it wrongly wrote, as
    a decoder that errs would): returns a counter of faulty decodes."""
    faults = [0]
    for name in names:
        cls = type(registry.codec(name))
        real_decode = cls.decode

        def decode(self: Any, payload: Any, n: int, out: Any, _real: Any = real_decode) -> Any:
            result = _real(self, payload, n, out)
            if n:
                result = bytearray(result) if out is None else result
                result[n // 2] ^= 0x04
                faults[0] += 1
            return result

        def decode_hashed(
            self: Any, payload: Any, n: int, out: Any, hasher: Any, _real: Any = real_decode
        ) -> None:
            data = decode(self, payload, n, out if out is not None else None, _real)
            if hasher is not None:
                hasher.update(data)

        monkeypatch.setattr(cls, "decode", decode)
        monkeypatch.setattr(cls, "decode_hashed", decode_hashed)
    return faults


@pytest.mark.parametrize("store", ["fast", "dense"], indirect=True)
@pytest.mark.parametrize("atomic", [True, False])
def test_a_decoder_that_errs_is_caught_by_the_default_restore(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    stored = {r.codec for r in store.repository.index.all_chunks()} - {objects.NONE}
    assert stored, "a compressed chunk to decode"
    faults = _faulty_decoders(monkeypatch, stored)
    dest = _zeros()
    with pytest.raises(ckstore.CorruptionError, match="does not match its check"):
        store.get("r").restore({"m": ckstore.StateDict(dest)}, atomic=atomic, memory_budget=0)
    assert faults[0] > 0
    if atomic:
        assert all(not t.any() for t in dest.values()), "an atomic restore touched the destination"
    with pytest.raises(ckstore.CorruptionError):
        store.get("r").read_object("m/w")


@pytest.mark.parametrize("store", ["fast"], indirect=True)
def test_the_benchmarks_switch_skips_only_the_check_of_the_decoded_bytes(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fetch.unchecked()`` (what the bench measures the check's share against) lets a decoder
    that errs through, and only inside it: the restores after it check again."""
    from ckstore.engine.restore.fetch import unchecked

    faults = _faulty_decoders(monkeypatch, {objects.EXP_ZSTD})
    with unchecked():
        dest = _restored(store, memory_budget=0)
    assert faults[0] > 0
    assert not torch.equal(dest["w"], _state()["w"])  # the flipped bit went through unseen
    with pytest.raises(ckstore.CorruptionError, match="does not match its check"):
        _restored(store, memory_budget=0)
