"""The second pass of an atomic restore checks what it decodes into place (docs/RELIABILITY.md,
I3): a compressed chunk past the memory budget is decoded twice, once to check it before
anything is touched and once into the destination. A decoder that errs only the second time (a
CPU or memory fault while decoding) used to land wrong bytes unseen; now the bytes decoded into
place are hashed against the chunk's check as they land, a decode that fails it runs once more,
and one that fails again raises naming the key."""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.restore import fetch
from ckstore.objects import chunk_reader
from ckstore.objects.codecs import registry
from tests.support.states import forget_payload_digests

KNOBS = {"chunk_bytes": 4 << 10, "pack_bytes": 64 << 10, "inline_bytes": 64}
_LAYER = itertools.count(1)
"""Each glitching patch flips its own byte: two patched layers flipping the same one would
cancel out."""


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(64, 64, generator=g) * 0.02,
        "h": torch.randn(4096, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(params=["local-fast", "local-dense", "memory-dense"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    """Compressed chunks on a store that maps its packs (kept views) and on one that does not
    (the second pass reads the payload again and compares its fingerprint)."""
    where, codec = request.param.split("-")
    url = str(tmp_path / "s") if where == "local" else f"memory://second-decode-{tmp_path.name}"
    s = ckstore.open(url, take_codec=codec, create=True, **KNOBS)
    s.take({"m": ckstore.StateDict(_state())}, run="r")
    yield s
    s.close()


def _glitching_decoders(monkeypatch: pytest.MonkeyPatch, names: set[str], bad: set[int]) -> None:
    """Make every codec in ``names`` flip a bit in the decodes of a payload whose ordinal (1:
    its first decode in this test) is in ``bad``, and hash what it wrongly wrote, as a decoder
    that errs would."""
    seen: dict[bytes, int] = {}
    layer = next(_LAYER)
    for name in names:
        cls = type(registry.codec(name))
        real_decode = cls.decode

        def decode(self: Any, payload: Any, n: int, out: Any, _real: Any = real_decode) -> Any:
            result = _real(self, payload, n, out)
            key = bytes(payload)
            seen[key] = seen.get(key, 0) + 1
            if n and seen[key] in bad:
                result = bytearray(result) if out is None else result
                result[(n // 2 + layer) % n] ^= 0x10
            return result

        def decode_hashed(
            self: Any, payload: Any, n: int, out: Any, hasher: Any, _real: Any = real_decode
        ) -> None:
            data = decode(self, payload, n, out, _real)
            if hasher is not None:
                hasher.update(data)

        monkeypatch.setattr(cls, "decode", decode)
        monkeypatch.setattr(cls, "decode_hashed", decode_hashed)


def _compressed(store: ckstore.Store) -> set[str]:
    stored = {r.codec for r in store.repository.index.all_chunks()} - {objects.NONE}
    assert stored, "a compressed chunk to decode"
    return stored


def _restore(store: ckstore.Store) -> dict[str, torch.Tensor]:
    dest = {k: torch.zeros_like(v) for k, v in _state().items()}
    store.get("r").restore({"m": ckstore.StateDict(dest)}, memory_budget=0)
    return dest


def test_a_decoder_that_errs_once_while_decoding_into_place_is_caught_and_decoded_again(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _glitching_decoders(monkeypatch, _compressed(store), bad={2})
    with caplog.at_level(logging.WARNING, logger="ckstore"):
        dest = _restore(store)
    for k, v in _state().items():
        assert torch.equal(dest[k], v), f"a wrong decode landed in {k}"
    assert any("decoded again" in r.getMessage() for r in caplog.records), caplog.text


def test_a_decoder_that_errs_every_time_it_decodes_into_place_raises_naming_the_key(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _glitching_decoders(monkeypatch, _compressed(store), bad=set(range(2, 10)))
    with pytest.raises(ckstore.CorruptionError, match=r"key 'm/(w|h)'.*does not match its check"):
        _restore(store)


def test_a_healthy_atomic_restore_past_the_budget_decodes_each_chunk_twice_and_lands_it_right(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _glitching_decoders(monkeypatch, _compressed(store), bad=set())
    dest = _restore(store)
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    again = _restore(store)  # the same process, the same payloads: nothing remembered wrongly
    assert all(torch.equal(again[k], v) for k, v in _state().items())


def test_a_healthy_restore_decodes_each_chunk_once_per_pass(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No retry without a mismatch: each compressed payload is decoded exactly twice."""
    counts: dict[bytes, int] = {}
    for name in _compressed(store):
        cls = type(registry.codec(name))
        real = cls.decode_hashed

        def counted(self: Any, payload: Any, n: int, out: Any, h: Any, _r: Any = real) -> None:
            counts[bytes(payload)] = counts.get(bytes(payload), 0) + 1
            _r(self, payload, n, out, h)

        monkeypatch.setattr(cls, "decode_hashed", counted)
    dest = _restore(store)
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    assert counts and set(counts.values()) == {2}, counts


# -- a delta chain, a chunk without a check, a restore by id -----------------------------------


def _chain_store(url: str) -> tuple[ckstore.Store, dict[str, torch.Tensor]]:
    """Three takes, each a small change of the last: the newest snapshot's chunks are XOR
    deltas onto its parent's, byte-grouped (decoded plane by plane, not by ``Codec.decode``)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    s = ckstore.open(url, create=True, take_codec="dense", **KNOBS)
    for step in range(3):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        s.take({"m": ckstore.StateDict({"w": w.clone()})}, run="r", step=step, delta_base="parent")
    assert any(r.base_id for r in s.repository.index.all_chunks()), "a delta to decode"
    return s, {"w": w}


def _glitching_planes(monkeypatch: pytest.MonkeyPatch, bad: set[int]) -> None:
    """Flip a bit of the planes of a payload's decodes whose ordinal is in ``bad`` (at an
    offset of its own: two links flipped alike would cancel under XOR)."""
    seen: dict[bytes, int] = {}
    layer = next(_LAYER)
    real = chunk_reader.decoded_planes

    def planes(payload: Any, n: int) -> Any:
        out = real(payload, n)
        key = bytes(payload)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] in bad:
            out = [p.copy() for p in out]
            out[0][(zlib.crc32(key) + layer) % len(out[0])] ^= 0x10
        return out

    monkeypatch.setattr(chunk_reader, "decoded_planes", planes)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_delta_chain_decoded_wrong_once_into_place_is_decoded_again(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "s") if where == "local" else f"memory://chain-{tmp_path.name}"
    s, want = _chain_store(url)
    try:
        _glitching_planes(monkeypatch, bad={2})
        dest = {"w": torch.zeros_like(want["w"])}
        s.get("r@2").restore({"m": ckstore.StateDict(dest)}, memory_budget=0)
        assert torch.equal(dest["w"], want["w"])
        _glitching_planes(monkeypatch, bad=set(range(2, 12)))
        with pytest.raises(ckstore.CorruptionError, match="key 'm/w'.*does not match its check"):
            s.get("r@2").restore({"m": ckstore.StateDict(dest)}, memory_budget=0)
    finally:
        s.close()


def test_a_chunk_without_a_check_or_digests_is_checked_by_id_as_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version-1 manifest records no check beside each id, and an index rebuilt by
    ``reindex`` no payload digests: the first pass hashes such a chunk against its id, and so
    does the second, as it decodes it into place."""
    s = ckstore.open(tmp_path / "s", take_codec="dense", create=True, **KNOBS)
    s.take({"m": ckstore.StateDict(_state())}, run="r")
    forget_payload_digests(s)
    real = fetch.Fetcher.verify

    def as_version_1(self: Any, jobs: Any, budget: Any) -> Any:
        for j in jobs:
            j.check = None
        return real(self, jobs, budget)

    monkeypatch.setattr(fetch.Fetcher, "verify", as_version_1)
    _glitching_decoders(monkeypatch, _compressed(s), bad={2})
    try:
        dest = _restore(s)
        assert all(torch.equal(dest[k], v) for k, v in _state().items())
        _glitching_decoders(monkeypatch, _compressed(s), bad=set(range(2, 10)))
        with pytest.raises(ckstore.CorruptionError, match="does not match its id"):
            _restore(s)
    finally:
        s.close()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_restore_by_id_decodes_again_what_it_decoded_wrong_once(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By id, the first pass compares each payload with its digest, undecoded: its one decode
    is the one into place, hashed against the id, and decoded again on a mismatch, on a store
    that maps its packs and on one that reads them again."""
    url = str(tmp_path / "s") if where == "local" else f"memory://by-id-{tmp_path.name}"
    s = ckstore.open(url, take_codec="dense", create=True, **KNOBS)
    s.take({"m": ckstore.StateDict(_state())}, run="r")
    try:
        _glitching_decoders(monkeypatch, _compressed(s), bad={1})
        dest = {k: torch.zeros_like(v) for k, v in _state().items()}
        s.get("r").restore({"m": ckstore.StateDict(dest)}, memory_budget=0, verify="full")
        assert all(torch.equal(dest[k], v) for k, v in _state().items())
        _glitching_decoders(monkeypatch, _compressed(s), bad=set(range(1, 10)))
        with pytest.raises(ckstore.CorruptionError, match="writer stored a wrong encoding"):
            s.get("r").restore({"m": ckstore.StateDict(dest)}, memory_budget=0, verify="full")
    finally:
        s.close()
