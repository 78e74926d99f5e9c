"""Codecs: round trips, the none fallback, byte grouping's gain, decoding into out, corruption."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects import BYTEGROUP_ZSTD, NONE, ZSTD, codecs, decode, encode
from ckstore.objects.codecs.registry import REGISTERED

RNG = np.random.default_rng(1234)


def _weights(n: int = 1 << 18) -> np.ndarray:
    return RNG.normal(0.0, 0.02, n).astype(np.float32)


def _bf16_like(n: int = 1 << 18) -> np.ndarray:
    return (_weights(n).view(np.uint32) >> 16).astype(np.uint16)


CASES = {
    "random": (RNG.bytes(100_000), 1, False),
    "float32": (_weights().tobytes(), 4, True),
    "bf16": (_bf16_like().tobytes(), 2, True),
    "zeros": (bytes(1 << 16), 4, True),
    "zeros-plain": (bytes(1 << 16), 1, False),
    "incompressible-grouped": (RNG.bytes(1 << 16), 4, True),
    "odd-length-grouped": (_weights(1001).tobytes()[:-1], 4, True),
    "empty": (b"", 4, True),
    "float64": (RNG.normal(0, 1, 10_000).tobytes(), 8, True),
    # fp32 upcast from bf16: the two low planes are all zeros, so planes 0 and 1 are
    # compressed and the raw plane 2 moves left behind them.
    "fp32-from-bf16": (
        (_weights().view(np.uint32) & 0xFFFF0000).astype(np.uint32).tobytes(),
        4,
        True,
    ),
    # only a middle plane compresses: plane 0 random, plane 1 constant, plane 2 random, 3 exp
    "middle-plane": (
        np.stack(
            [
                RNG.integers(0, 256, 1 << 16),
                np.full(1 << 16, 7),
                RNG.integers(0, 256, 1 << 16),
                RNG.integers(60, 62, 1 << 16),
            ],
            axis=1,
        )
        .astype(np.uint8)
        .tobytes(),
        4,
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip(case: str) -> None:
    raw, itemsize, grouped = CASES[case]
    codec, payload = encode(raw, itemsize, grouped)
    assert bytes(decode(codec, payload, len(raw))) == raw
    out = memoryview(bytearray(len(raw)))
    assert decode(codec, payload, len(raw), out) is out
    assert bytes(out) == raw


def test_grouped_layout_flags_and_lengths() -> None:
    """The payload is header, plane table, then the planes back to back (FORMAT.md)."""
    import struct

    raw, itemsize, _ = CASES["middle-plane"]
    codec, payload = encode(raw, itemsize, True)
    assert codec == BYTEGROUP_ZSTD
    view = bytes(payload)
    assert view[:2] == bytes([1, itemsize])
    table = [struct.unpack_from("<BQ", view, 2 + 9 * i) for i in range(itemsize)]
    assert [flag for flag, _ in table] == [0, 1, 0, 1]
    plane = len(raw) // itemsize
    assert table[0][1] == plane and table[2][1] == plane and table[1][1] < plane // 100
    assert len(view) == 2 + 9 * itemsize + sum(n for _, n in table)
    pos = 2 + 9 * itemsize
    assert view[pos : pos + plane] == raw[0::4]
    pos += plane + table[1][1]
    assert view[pos : pos + plane] == raw[2::4]


def test_random_bytes_stay_raw_without_copy() -> None:
    raw = RNG.bytes(100_000)
    codec, payload = encode(raw, 1, False)
    assert codec == NONE and payload is raw


def test_bytegroup_beats_plain_zstd_on_weights() -> None:
    raw = _weights().tobytes()
    codec, payload = encode(raw, 4, True)
    plain = zstandard.ZstdCompressor(level=1).compress(raw)
    assert codec == BYTEGROUP_ZSTD
    assert len(payload) < 0.95 * len(plain)
    assert len(payload) < 0.9 * len(raw)


def test_bf16_gain() -> None:
    raw = _bf16_like().tobytes()
    codec, payload = encode(raw, 2, True)
    assert codec == BYTEGROUP_ZSTD and len(payload) < 0.8 * len(raw)


def test_plain_zstd_when_not_grouped() -> None:
    codec, payload = encode(bytes(1 << 16), 4, False)
    assert codec == ZSTD and len(payload) < 100


def test_accepts_numpy_buffers() -> None:
    arr = _weights(4096)
    codec, payload = encode(arr, 4, True)
    assert bytes(decode(codec, payload, arr.nbytes)) == arr.tobytes()


@pytest.mark.parametrize("case", ["float32", "zeros-plain"])
def test_corrupt_payload(case: str) -> None:
    raw, itemsize, grouped = CASES[case]
    codec, payload = encode(raw, itemsize, grouped)
    for bad in (bytes(payload)[: len(payload) // 2], b"\x00" * 3, bytes(payload) + b"x"):
        with pytest.raises(CorruptionError):
            decode(codec, bad, len(raw))
    with pytest.raises(CorruptionError):
        decode(codec, payload, len(raw) + 4)


def test_flipped_byte_in_zstd_frame_never_decodes_silently_wrong() -> None:
    raw = bytes(range(256)) * 400
    codec, payload = encode(raw, 1, False)
    assert codec == ZSTD
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0xFF
    try:
        result = bytes(decode(codec, bytes(bad), len(raw)))
    except CorruptionError:
        return
    assert result != raw  # detected later by the hash check in ObjectStore.read_chunk


def test_none_wrong_length() -> None:
    with pytest.raises(CorruptionError):
        decode(NONE, b"abc", 4)


def test_unknown_codec_is_named() -> None:
    with pytest.raises(CorruptionError, match="lz4"):
        decode("lz4", b"abc", 3)


def test_bad_out_buffer() -> None:
    codec, payload = encode(bytes(100), 1, False)
    with pytest.raises(InvalidInputError):
        decode(codec, payload, 100, memoryview(bytearray(99)))
    with pytest.raises(InvalidInputError):
        decode(codec, payload, 100, memoryview(bytes(100)))


# --- the registry: every codec by name and pack id, each held to the Codec contract -----------


def test_registry_gives_each_codec_one_name_and_the_next_pack_id() -> None:
    from ckstore.objects import packs

    assert [c.pack_id for c in REGISTERED] == list(range(len(REGISTERED)))
    assert list(codecs.CODECS) == [c.name for c in REGISTERED]
    assert len(set(codecs.CODECS)) == len(REGISTERED)
    assert packs.CODEC_IDS == {c.name: c.pack_id for c in REGISTERED}
    for c in REGISTERED:
        assert codecs.codec(c.name) is c and c.pack_version <= packs.LATEST_FORMAT_VERSION
        if c.inner is not None:  # a delta names its base: the entries of version 2 and later
            assert codecs.is_delta(c.name) and codecs.delta_inner(c.name) == c.inner.name
            assert c.inner in REGISTERED and c.inner.inner is None
            assert c.pack_version >= packs.DELTA_FORMAT_VERSION
            assert codecs.DELTA_OF[c.inner.name] == c.name


def test_format_md_lists_every_codec_with_its_pack_id() -> None:
    """FORMAT.md section 5's table is the registry, row by row."""
    import re

    from tests.support.paths import REPO

    text = (REPO / "docs" / "FORMAT.md").read_text()
    section = text[text.index("## 5. Codecs") : text.index("## 6. Packs")]
    rows = re.findall(r"^\| (\d+) \| `([a-z0-9-]+)` \|", section, flags=re.M)
    assert [(int(i), name) for i, name in rows] == [(c.pack_id, c.name) for c in REGISTERED]


def _fitting(codec_name: str) -> list[tuple[bytes, int]]:
    """Chunks the codec's encoder takes: weights as float32 and as bf16, and plain bytes."""
    c = codecs.codec(codec_name)
    chunks = [
        (_weights(1 << 14).tobytes(), 4),
        (_bf16_like(1 << 14).tobytes(), 2),
        (bytes(range(256)) * 64, 1),
    ]
    fit = [(raw, k) for raw, k in chunks if c.fits(len(raw), k)]
    assert fit, codec_name
    return fit


@pytest.mark.parametrize("name", [c.name for c in REGISTERED])
def test_every_codec_keeps_the_codec_contract(name: str) -> None:
    """What ``codecs.base.Codec`` promises, for each registered codec: its payloads decode to
    the raw bytes by ``decode`` and ``decode_hashed``, into ``out`` or not, hashed in order; a
    payload cut short or with a byte after it is refused."""
    from ckstore.objects.hashing import chunk_id, new_hasher

    c = codecs.codec(name)
    for raw, itemsize in _fitting(name):
        payload = bytes(c.encode(memoryview(raw), itemsize, 1, None))
        assert bytes(decode(name, payload, len(raw))) == raw
        out = memoryview(bytearray(len(raw)))
        assert decode(name, payload, len(raw), out) is out and bytes(out) == raw
        for target in (None, memoryview(bytearray(len(raw)))):
            hasher = new_hasher()
            codecs.decode_hashed(name, payload, len(raw), target, hasher)
            assert hasher.hexdigest() == chunk_id(raw)
            assert target is None or bytes(target) == raw
        for bad in (payload[:-1], payload + b"\x00"):
            with pytest.raises(CorruptionError):
                codecs.decode_hashed(name, bad, len(raw), None, new_hasher())
