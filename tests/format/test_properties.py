"""Property-based tests (hypothesis) of the parsers that read untrusted bytes, and of value encoding.

Properties:

- Values: every storable value survives encode -> canonical JSON -> decode unchanged (type
  included), and any JSON document fed to ``decode_value`` either decodes or raises
  ``CorruptionError``: never another exception.
- Manifests: ``Manifest.from_json`` on arbitrary bytes, on arbitrary JSON shaped like a manifest,
  and on valid manifests with bytes flipped, cut or inserted, returns a manifest or raises
  ``CorruptionError``.
- Packs: ``read_pack_index``/``scan_pack`` on arbitrary bytes raise ``CorruptionError`` (or read a
  valid pack); on a valid pack with any single byte changed, the damage is always seen: a
  ``CorruptionError`` or a problem in the scan (every byte of a pack is covered by its id, its
  trailer checksum or a chunk id).
- Codecs: ``decode`` of arbitrary payloads raises ``CorruptionError`` or returns exactly
  ``raw_length`` bytes; ``encode`` -> ``decode`` is the identity.

Each runs a bounded number of examples (derandomized, so CI is repeatable); set
``CKSTORE_SOAK=1`` for the long soak profile (many more examples, random seeds).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore import objects
from ckstore.errors import CorruptionError
from ckstore.format.limits import INT64_MIN, UINT64_MAX
from ckstore.format.manifest import Manifest, TensorEntry, ValueEntry, canonical_json
from ckstore.format.values import decode_value, encode_value
from ckstore.objects import codecs
from ckstore.objects import packs as packfmt

SOAK = bool(os.environ.get("CKSTORE_SOAK"))
settings.register_profile(
    "bounded",
    max_examples=80,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "soak",
    max_examples=5000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("soak" if SOAK else "bounded")

# bounded by default; CKSTORE_SOAK=1 runs the long form (with room for it)
pytestmark = [pytest.mark.soak, pytest.mark.timeout(7200 if SOAK else 300)]


# --- values ------------------------------------------------------------------------------------------
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT64_MIN, UINT64_MAX),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(
        [torch.float32, torch.bfloat16, torch.int8, torch.device("cpu"), torch.Size([2, 0])]
    ),
    st.builds(np.float32, st.floats(width=32, allow_nan=False)),
    st.builds(np.int64, st.integers(INT64_MIN, 2**63 - 1)),
)
_keys = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=4).map(OrderedDict),
    ),
    max_leaves=25,
)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a == 0:
        return math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


@given(_values)
def test_values_round_trip_exactly(value):
    encoded = json.loads(canonical_json(encode_value(value, "k")))
    assert _same(decode_value(encoded), value)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "$tuple",
                        "$dict",
                        "$cls",
                        "$float",
                        "$bytes",
                        "$dtype",
                        "$device",
                        "$size",
                        "$np",
                        "b64",
                        "$ref",
                        "$meta",
                    ]
                ),
                st.text(max_size=5),
            ),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=20,
)


@given(_json)
def test_decoding_any_json_value_gives_a_value_or_corruption(data):
    try:
        decode_value(data)
    except CorruptionError:
        pass


# --- manifests -----------------------------------------------------------------------------------
def _valid_manifest() -> bytes:
    cid = objects.chunk_id(b"x" * 16)
    entries = {
        "m/w": TensorEntry("float32", (8,), (), (4,)),
        "m/s": ValueEntry(encode_value({"lr": 0.1, "betas": (0.9, 0.99)}, "m/s")),
        "m/i": TensorEntry("int8", (2,), data=b"\x01\x02"),
    }
    from ckstore.format.manifest import ChunkRef

    entries["m/w"] = TensorEntry(
        "float32", (8,), (ChunkRef((0,), (4,), cid), ChunkRef((4,), (4,), cid)), (4,)
    )
    apps = {
        "m": {
            "$cls": "dict",
            "$dict": [["w", {"$ref": "m/w"}], ["s", {"$ref": "m/s"}], ["i", [{"$ref": "m/i"}]]],
        }
    }
    return Manifest(apps, entries, {"run": "r", "step": 1}).to_json()


VALID = _valid_manifest()


def _parses_or_corrupt(raw: bytes) -> None:
    try:
        Manifest.from_json(raw, "manifest under test")
    except CorruptionError:
        pass


@given(st.binary(max_size=300))
def test_manifest_parser_on_arbitrary_bytes(raw):
    _parses_or_corrupt(raw)


@given(st.data())
def test_manifest_parser_on_mutated_valid_manifests(data):
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[at:]
        elif op == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif raw:
            del raw[at]
    _parses_or_corrupt(bytes(raw))


_entry = st.fixed_dictionaries(
    {"kind": st.sampled_from(["tensor", "value", "per_rank", "pickle"])},
    optional={
        "dtype": st.sampled_from(["float32", "int8", "bogus", 3]),
        "shape": st.lists(st.integers(-2, 5), max_size=3) | _json,
        "block": st.lists(st.integers(0, 5), max_size=3) | _json,
        "chunks": st.lists(
            st.lists(_json | st.lists(st.integers(-1, 5), max_size=3), max_size=3), max_size=3
        ),
        "data": st.sampled_from(["", "AAAA", "!!", "AAECAw=="]) | _json,
        "value": _json,
        "ranks": st.lists(_json, max_size=2) | _json,
        "container": st.sampled_from(["torch", "numpy", "pickle"]),
    },
)


@given(
    st.dictionaries(st.text(max_size=4), _entry, max_size=3),
    st.dictionaries(st.text(max_size=3), _json, max_size=2),
)
def test_manifest_parser_on_arbitrary_documents_shaped_like_manifests(entries, apps):
    doc = {"format": "ckstore/manifest", "version": 1, "apps": apps, "entries": entries}
    _parses_or_corrupt(json.dumps(doc).encode())


# --- packs ------------------------------------------------------------------------------------------
def _pack_with(chunks: list[tuple[bytes, str]]) -> tuple[Any, str, bytes]:
    backend = objects.memory_backend()
    writer = packfmt.PackWriter(backend)
    for raw, codec in chunks:
        itemsize = 4 if len(raw) % 4 == 0 else 1
        used, payload = (
            codecs.encode(raw, itemsize, codec == "bytegroup-zstd")
            if codec != "none"
            else ("none", raw)
        )
        writer.add(objects.chunk_id(raw), used, payload, len(raw))
    done = writer.finish()
    assert done is not None
    pack_id = done[0]
    return backend, pack_id, backend.get(packfmt.pack_name(pack_id))


_chunks = st.lists(
    st.tuples(
        st.binary(min_size=1, max_size=200).map(lambda b: b * 3),
        st.sampled_from(["none", "zstd", "bytegroup-zstd"]),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda c: c[0],
)


@given(st.binary(max_size=400))
def test_pack_parser_on_arbitrary_bytes(raw):
    backend = objects.memory_backend()
    pack_id = objects.chunk_id(raw)
    backend.put(packfmt.pack_name(pack_id), raw)
    try:
        with pytest.raises(CorruptionError):
            packfmt.read_pack_index(backend, pack_id)  # 400 random bytes are never a valid pack
        with pytest.raises(CorruptionError):
            objects.verify_pack(backend, pack_id)
    finally:
        backend.delete(packfmt.pack_name(pack_id))  # the memory filesystem is process-global


@given(_chunks, st.data())
def test_any_changed_byte_of_a_pack_is_always_seen(chunks, data):
    backend, pack_id, raw = _pack_with(chunks)
    assert objects.scan_pack(backend, pack_id).ok
    damaged = bytearray(raw)
    at = data.draw(st.integers(0, len(raw) - 1))
    damaged[at] ^= data.draw(st.integers(1, 255))
    assert not _scan_replaced(backend, pack_id, bytes(damaged)), (
        f"byte {at} of a {len(raw)}-byte pack changed unseen"
    )


@given(_chunks, st.integers(1, 80), st.binary(max_size=8))
def test_cut_or_extended_packs_are_always_seen(chunks, cut, extra):
    backend, pack_id, raw = _pack_with(chunks)
    assert not _scan_replaced(backend, pack_id, raw[: max(0, len(raw) - cut)] + extra)


def _scan_replaced(backend, pack_id, data: bytes) -> bool:
    """Whether a whole-pack scan finds the pack sound once its bytes are replaced by ``data``
    (an unreadable table counts as found unsound); the pack is deleted afterwards."""
    backend.delete(packfmt.pack_name(pack_id))
    backend.put(packfmt.pack_name(pack_id), data)
    try:
        return objects.scan_pack(backend, pack_id).ok
    except CorruptionError:
        return False
    finally:
        backend.delete(packfmt.pack_name(pack_id))


# --- codecs -------------------------------------------------------------------------------------
@given(
    st.sampled_from(codecs.CODECS + ("bogus",)), st.binary(max_size=300), st.integers(0, 1 << 20)
)
def test_decoding_arbitrary_payloads_gives_the_raw_length_or_corruption(codec, payload, raw_length):
    try:
        out = codecs.decode(codec, payload, raw_length)
    except CorruptionError:
        return
    assert len(out) == raw_length


@given(st.binary(max_size=2000), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_encode_then_decode_is_the_identity(raw, itemsize, grouped):
    raw = raw[: len(raw) - len(raw) % itemsize]
    codec, payload = codecs.encode(raw, itemsize, grouped)
    assert bytes(codecs.decode(codec, payload, len(raw))) == raw


@given(st.binary(min_size=8, max_size=300).map(lambda b: b * 4), st.data())
def test_changed_payload_bytes_never_decode_silently_to_other_bytes(raw, data):
    codec, payload = codecs.encode(raw, 4, data.draw(st.booleans()))
    damaged = bytearray(payload)
    at = data.draw(st.integers(0, len(damaged) - 1))
    damaged[at] ^= data.draw(st.integers(1, 255))
    try:
        out = codecs.decode(codec, bytes(damaged), len(raw))
    except CorruptionError:
        return
    # decoding may succeed (codec none, raw zstd blocks): the chunk id is what catches it
    assert bytes(out) != raw or codec != "none"
    if bytes(out) != raw:
        assert objects.chunk_id(bytes(out)) != objects.chunk_id(raw)
