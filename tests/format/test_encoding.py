"""Value encoding, state flattening, the chunk grid and manifest validation."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ckstore.errors import CorruptionError, InvalidInputError, UnsupportedValueError
from ckstore.format.grid import make_grid
from ckstore.format.manifest import Manifest, TensorEntry, canonical_json
from ckstore.format.tree import flatten, subtree, tree_refs, unflatten
from ckstore.format.values import decode_value, encode_value

PLAIN = [
    None,
    True,
    0,
    -(2**63),
    2**64 - 1,  # the largest: an unsigned 64-bit seed (torch.initial_seed())
    1.5,
    -0.0,
    float("inf"),
    "héllo/x",
    b"\x00\xff",
    [1, "a", None],
    (1, (2.5, "b")),
    {"a": 1, 2: "b", None: [3]},
    OrderedDict([("z", 1), ("a", 2)]),
    torch.float16,
    torch.device("cpu"),
    torch.Size([2, 3]),
    np.float32(1.25),
    np.int64(-7),
]


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_round_trip_through_json(value):
    back = decode_value(__import__("json").loads(canonical_json(encode_value(value, "k"))))
    assert type(back) is type(value)
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, back) == math.copysign(1, value)
    assert back == value
    if isinstance(value, dict):
        assert list(back) == list(value)


def test_nan_round_trips():
    assert math.isnan(decode_value(encode_value(float("nan"), "k")))


def test_three_values_come_back_as_their_plainer_kin_as_the_docs_say():
    """USAGE.md and FORMAT.md: a bytearray comes back as bytes, a named tuple as a tuple, and
    a Python float NaN as the one NaN (no sign or payload bits)."""
    from collections import namedtuple

    pair = namedtuple("pair", "a b")

    def trip(v: object) -> object:
        return decode_value(__import__("json").loads(canonical_json(encode_value(v, "k"))))

    back = trip(bytearray(b"\x00\x01"))
    assert type(back) is bytes and back == b"\x00\x01"
    back = trip(pair(1, 2))
    assert type(back) is tuple and back == (1, 2)
    import enum

    class Color(str, enum.Enum):  # noqa: UP042 - the older spelling, as most code has it
        RED = "red"

    encoded = encode_value(Color.RED, "k")  # what the take's own handle holds, too
    assert type(encoded) is str and encoded == "red"
    back = trip(-float("nan"))
    assert math.isnan(back) and math.copysign(1, back) == 1  # type: ignore[arg-type]


def test_unsupported_value_names_its_key():
    with pytest.raises(UnsupportedValueError, match="'model/fn'.*StateDict"):
        flatten("model", {"fn": lambda: 1})
    with pytest.raises(UnsupportedValueError, match="object"):
        encode_value(object(), "x")


def test_colliding_keys_are_refused():
    with pytest.raises(InvalidInputError, match="both map"):
        flatten("s", {1: torch.zeros(1), "1": torch.ones(1)})


def test_flatten_unflatten_keeps_structure_and_order():
    sd = OrderedDict([("w", torch.ones(2)), ("b/x", torch.zeros(1))])
    sd._metadata = {"": {"version": 1}}
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "model": sd,
    }
    flat = flatten("optim", state)
    assert "optim/model/b%2Fx" in flat.leaves
    assert "optim/groups/0/params" in flat.leaves  # a list of plain values stays one leaf
    assert tree_refs(flat.tree) == list(flat.leaves)
    back = unflatten(flat.tree, flat.leaves.__getitem__)
    assert list(back["model"]) == ["w", "b/x"] and back["model"]._metadata == {"": {"version": 1}}
    assert isinstance(back["model"], OrderedDict) and list(back["state"]) == [0]
    assert subtree(flat.tree, "optim", "optim/state/0") is not None
    assert subtree(flat.tree, "optim", "optim/nope") is None


@pytest.mark.parametrize(
    "shape,chunk,block",
    [
        ((10, 4), 16, (1, 4)),
        ((10, 4), 1000, (10, 4)),
        ((3, 1000), 100, (1, 25)),
        ((), 8, ()),
        ((2, 3, 4), 8, (1, 1, 2)),
    ],
)
def test_grid_blocks_tile_the_tensor_contiguously(shape, chunk, block):
    g = make_grid(shape, 4, chunk)
    assert g.block == block
    ranges = [g.byte_range(o, s) for o, s in g.boxes()]
    assert ranges[0][0] == 0 and ranges[-1][1] == g.nbytes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(stop - start <= max(chunk, 4) for start, stop in ranges)


def test_grid_is_independent_of_everything_but_shape_dtype_and_chunk_size():
    assert make_grid((1000, 64), 2, 4096) == make_grid((1000, 64), 2, 4096)
    assert list(make_grid((0, 5), 4, 8).boxes()) == []


def _entry(**kw):
    base = {
        "kind": "tensor",
        "dtype": "float32",
        "shape": [4],
        "block": [2],
        "chunks": [[[0], [2], "a" * 64], [[2], [2], "b" * 64]],
    }
    base.update(kw)
    return base


def _manifest(entry):
    return canonical_json(
        {
            "format": "ckstore/manifest",
            "version": 1,
            "apps": {"m": {"$ref": "m/w"}},
            "entries": {"m/w": entry},
        }
    )


def test_manifest_parses_valid_entries():
    m = Manifest.from_json(_manifest(_entry()))
    e = m.entries["m/w"]
    assert isinstance(e, TensorEntry) and e.nbytes == 16 and len(e.chunks) == 2
    assert Manifest.from_json(m.to_json()).to_json() == m.to_json()


@pytest.mark.parametrize(
    "bad",
    [
        _entry(dtype="object"),
        _entry(shape=[-1]),
        _entry(chunks=[[[0], [2], "a" * 64]]),  # does not cover the tensor
        _entry(chunks=[[[3], [2], "a" * 64], [[0], [2], "b" * 64]]),  # outside the shape
        _entry(chunks=[[[0], [2], "not-hex"], [[2], [2], "b" * 64]]),
        {"kind": "pickle", "value": "x"},
        {"kind": "value", "value": {"$unknown": 1}},
    ],
)
def test_manifest_rejects_malformed_entries(bad):
    with pytest.raises(CorruptionError):
        Manifest.from_json(_manifest(bad))


def test_manifest_rejects_non_json_and_other_formats():
    with pytest.raises(CorruptionError):
        Manifest.from_json(b"\x80not json")
    with pytest.raises(CorruptionError):
        Manifest.from_json(b'{"format": "other"}')
