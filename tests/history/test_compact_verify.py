"""Verify before you drop (issue 34, item 3): compaction decodes every payload it re-encoded
(delta or dense) and compares it with the chunk before the index switches to it and before the
loose original becomes garbage.

A fault hook wraps the encoders compaction calls: it flips one bit of the output buffer, or
takes the delta against other bytes than the base the row will name. Every faulted encoding
is refused (the chunk stays loose, counted in ``encodings_refused``), no snapshot is damaged
(each restores bit for bit and ``check --read-data`` is clean), and the next compaction,
without the fault, rewrites them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore import objects
from ckstore.history import compact as compact_module
from tests.history.test_compact import KNOBS, _loose, _run, _take_all
from tests.support.deltas import restores


def _decoded(codec: str, payload: Any, size: int) -> bytes | None:
    """What ``payload`` decodes to (a delta's: its XOR bytes), or None if it does not decode."""
    try:
        return bytes(objects.decode(codec, payload, size))
    except Exception:  # noqa: BLE001 - any failure to decode is a fault the check must catch
        return None


class Faults:
    """Wraps ``objects.encode`` and ``objects.encode_delta`` as compaction calls them; each call
    is faulted with probability ``rate`` (seeded). ``faulted`` counts the faults that changed
    what the payload decodes to, which the check must refuse; ``flipped`` every flipped payload
    (a flipped bit the decoder ignores, in a frame header field, may be refused or kept: the
    chunk's bytes are right either way)."""

    def __init__(self, kind: str, rate: float, seed: int) -> None:
        self.kind, self.rate, self.rng = kind, rate, random.Random(seed)
        self.calls = self.faulted = self.flipped = 0
        self._encode, self._encode_delta = objects.encode, objects.encode_delta

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(compact_module.objects, "encode", self.encode)
        monkeypatch.setattr(compact_module.objects, "encode_delta", self.encode_delta)

    def _flip(self, codec: str, payload: Any, raw: Any) -> tuple[str, Any]:
        out = bytearray(payload)
        if out:
            out[self.rng.randrange(len(out))] ^= 1 << self.rng.randrange(8)
            self.flipped += 1
            size = memoryview(raw).nbytes
            self.faulted += _decoded(codec, bytes(out), size) != _decoded(codec, payload, size)
        return codec, bytes(out)

    def encode(self, raw: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        self.calls += 1
        codec, payload = self._encode(raw, *args, **kwargs)
        if self.kind == "flip" and self.rng.random() < self.rate:
            return self._flip(codec, payload, raw)
        return codec, payload

    def encode_delta(self, raw: Any, base: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        self.calls += 1
        if self.kind == "flip" and self.rng.random() < self.rate:
            return self._flip(*self._encode_delta(raw, base, *args, **kwargs), raw)
        if self.kind == "wrong-base" and self.rng.random() < self.rate:
            other = bytearray(base)  # a near miss: the delta stays small, so it is kept
            other[self.rng.randrange(len(other))] ^= 1 << self.rng.randrange(8)
            codec, payload = self._encode_delta(raw, bytes(other), *args, **kwargs)
            self.faulted += objects.is_delta(codec)  # a plain encoding ignores the base
            return codec, payload
        return self._encode_delta(raw, base, *args, **kwargs)


@pytest.mark.parametrize(("kind", "seed"), [("flip", 1), ("flip", 2), ("wrong-base", 3)])
def test_every_faulted_encoding_is_caught_and_no_snapshot_is_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, seed: int
) -> None:
    states = _run(6, seed=seed)
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        ids = _take_all(store, states)
        loose = _loose(store)
        faults = Faults(kind, rate=0.5 if kind == "flip" else 1.0, seed=seed)
        with monkeypatch.context() as m:
            faults.install(m)
            report = store.compact()
        refused = report.encodings_refused
        assert faults.faulted > 0 and faults.calls >= report.chunks + refused
        if kind == "flip":  # every flip that changed the bytes refused, none without a flip
            assert faults.faulted <= refused <= faults.flipped
        else:
            assert refused == faults.faulted  # 100 % caught, none refused without a fault
        assert len(_loose(store)) == len(loose) - report.chunks  # the refused stay loose
        for i, s in zip(ids, states):  # 0 snapshots damaged
            assert restores(store, i, s)
        assert store.check(read_data=True).ok
        again = store.compact()  # without the fault: the rest is rewritten
        assert again.encodings_refused == 0 and again.chunks == report.encodings_refused
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_the_check_is_timed_apart(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        _take_all(store, _run(4))
        report = store.compact()
    assert report.chunks > 0 and report.delta_chunks > 0 and report.encodings_refused == 0
    assert 0 < report.check_cpu_seconds < report.cpu_seconds


def test_a_payload_that_does_not_decode_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder that names a codec its payload is not: refused, left loose, readable."""
    states = _run(3)

    def bogus(raw: Any, *args: Any, **kwargs: Any) -> tuple[str, bytes]:
        return "zstd", b"not a frame"

    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as store:
        ids = _take_all(store, states)
        monkeypatch.setattr(compact_module.objects, "encode_delta", bogus)
        monkeypatch.setattr(compact_module.objects, "encode", bogus)
        report = store.compact()
        assert report.chunks == 0 and report.encodings_refused > 0
        for i, s in zip(ids, states):
            assert restores(store, i, s)
