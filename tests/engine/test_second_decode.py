"""The second pass of an atomic restore checks what it decodes into place (docs/RELIABILITY.md,
I3): a compressed chunk past the memory budget is decoded twice, once to check it before
anything is touched and once into the destination. A decoder that errs only the second time (a
CPU or memory fault while decoding) used to land wrong bytes unseen; now the bytes decoded into
place are hashed against the chunk's check as they land, a decode that fails it runs once more,
and one that fails again raises naming the key."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.objects.codecs import registry

KNOBS = {"chunk_bytes": 4 << 10, "pack_bytes": 64 << 10, "inline_bytes": 64}


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
    for name in names:
        cls = type(registry.codec(name))
        real_decode = cls.decode

        def decode(self: Any, payload: Any, n: int, out: Any, _real: Any = real_decode) -> Any:
            result = _real(self, payload, n, out)
            key = bytes(payload)
            seen[key] = seen.get(key, 0) + 1
            if n and seen[key] in bad:
                result = bytearray(result) if out is None else result
                result[n // 2] ^= 0x10
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
