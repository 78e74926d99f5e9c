"""Snapshot diffs through the Python API: classification, chunk fractions, numeric summaries."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ckstore
from ckstore.history.diff import DiffResult

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
ROW = 256  # float32 elements per 1 KiB row: one chunk per row with TINY knobs


@pytest.fixture
def store(tmp_path):
    s = ckstore.open(tmp_path / "store", **TINY, create=True)
    yield s
    s.close()


def _state(**leaves):
    return {"m": ckstore.StateDict(**leaves)}


@pytest.fixture
def pair(store):
    """Snapshots a (r@1) and b (r@2): w has 1 of 10 rows changed, and every other kind of change."""
    torch.manual_seed(0)
    w = torch.randn(10, ROW)
    a = _state(
        w=w,
        same=torch.arange(1000.0),
        reshaped=torch.zeros(4, 300),
        cast=torch.ones(500),
        small=torch.zeros(3),
        lr=0.1,
        gone=torch.ones(400),
    )
    w2 = w.clone()
    w2[7] += torch.linspace(-2.0, 3.0, ROW)
    b = _state(
        w=w2,
        same=torch.arange(1000.0),
        reshaped=torch.zeros(300, 4),
        cast=torch.ones(500, dtype=torch.float64),
        small=torch.tensor([1.0, -2.0, 0.5]),
        lr=0.05,
        new=torch.ones(70),
    )
    store.take(a, run="r", step=1, tags=["first"])
    store.take(b, run="r", step=2)
    return w, w2


def test_keys_are_classified_by_digest(store, pair):
    d = store.diff("r@1", "r@2")
    assert isinstance(d, DiffResult)
    assert {k.key for k in d.added} == {"m/new"}
    assert {k.key for k in d.removed} == {"m/gone"}
    assert {k.key for k in d.unchanged} == {"m/same"}
    assert {k.key for k in d.changed} == {"m/w", "m/reshaped", "m/cast", "m/small", "m/lr"}
    assert d.counts == {"added": 1, "removed": 1, "changed": 5, "unchanged": 1}
    assert d.bytes["added"] == 280 and d.bytes["removed"] == 1600 and d.bytes["unchanged"] == 4000
    assert d["m/w"].bytes_a == d["m/w"].bytes_b == 10 * ROW * 4
    assert not d.identical and store.diff("r@2", "r@2").identical


def test_chunk_fraction_when_one_of_ten_rows_changes(store, pair):
    w = store.diff("first", "r")["m/w"]
    assert (w.changed_chunks, w.total_chunks) == (1, 10)
    assert w.chunk_fraction == pytest.approx(0.1)
    assert w.changed_bytes == ROW * 4
    assert w.reason is None and w.numeric is None


def test_whole_changes_say_why(store, pair):
    d = store.diff("r@1", "r@2")
    assert d["m/reshaped"].chunk_fraction == 1.0 and "shape" in d["m/reshaped"].reason
    assert d["m/cast"].chunk_fraction == 1.0 and "dtype" in d["m/cast"].reason
    assert d["m/small"].chunk_fraction == 1.0 and "inline" in d["m/small"].reason
    assert d["m/lr"].chunk_fraction is None and d["m/lr"].reason == "value changed"


def test_cheap_diff_reads_no_tensor_data(store, pair, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("diff without numeric must not read chunks")

    monkeypatch.setattr(store.repository.objects, "read_chunk", boom)
    assert store.diff("r@1", "r@2").counts["changed"] == 5


def test_numeric_summary_matches_torch(store, pair, monkeypatch):
    w, w2 = pair
    reads = []
    real = store.repository.objects.read_chunk
    monkeypatch.setattr(
        store.repository.objects,
        "read_chunk",
        lambda loc, out=None: reads.append(loc.chunk_id) or real(loc, out),
    )
    d = store.diff("r@1", "r@2", numeric=True)
    n = d["m/w"].numeric
    a, b = w.double(), w2.double()
    assert n.elements == ROW
    assert n.max_abs_diff == pytest.approx(float((b - a).abs().max()), rel=1e-12)
    assert n.l2_diff == pytest.approx(float(torch.linalg.vector_norm(b - a)), rel=1e-12)
    assert n.l2_a == pytest.approx(float(torch.linalg.vector_norm(a[7])), rel=1e-12)
    assert n.l2_b == pytest.approx(float(torch.linalg.vector_norm(b[7])), rel=1e-12)
    assert len(reads) == 2  # only the changed chunk, once per side
    small = d["m/small"].numeric  # inline: compared from the manifests
    assert small.max_abs_diff == 2.0 and small.l2_b == pytest.approx(math.sqrt(5.25))
    assert d["m/reshaped"].numeric is None and d["m/cast"].numeric is None


def test_numeric_bfloat16_is_computed_in_float64(store):
    x = torch.randn(8, 512).bfloat16()  # 1 KiB rows
    y = x.clone()
    y[2:4] = y[2:4] * 3
    store.take(_state(x=x), run="bf", step=0)
    store.take(_state(x=y), run="bf", step=1)
    k = store.diff("bf@0", "bf@1", numeric=True)["m/x"]
    assert (k.changed_chunks, k.total_chunks) == (2, 8)
    diff = y.double() - x.double()
    assert k.numeric.l2_diff == pytest.approx(float(torch.linalg.vector_norm(diff)), rel=1e-12)
    assert k.numeric.max_abs_diff == pytest.approx(float(diff.abs().max()), rel=1e-12)


def test_result_is_json_serialisable(store, pair):
    d = store.diff("first", "r@2", numeric=True).to_dict()
    back = json.loads(json.dumps(d, allow_nan=False))
    assert back["counts"]["changed"] == 5
    assert back["a"]["run"] == "r" and back["a"]["step"] == 1 and back["b"]["step"] == 2
    w = next(k for k in back["keys"] if k["key"] == "m/w")
    assert w["shape_b"] == [10, ROW] and w["chunk_fraction"] == pytest.approx(0.1)


def test_non_finite_values_stay_valid_json(store):
    x = torch.zeros(4, ROW)
    y = x.clone()
    y[0, 0] = float("nan")
    store.take(_state(x=x), run="n", step=0)
    store.take(_state(x=y), run="n", step=1)
    d = store.diff("n@0", "n@1", numeric=True)
    assert math.isnan(d["m/x"].numeric.max_abs_diff)
    assert (
        json.loads(json.dumps(d.to_dict(), allow_nan=False))["keys"][0]["numeric"]["max_abs_diff"]
        == "nan"
    )


def test_refs_and_unknown_ref(store, pair):
    first = store.get("first")
    assert store.diff(first.id[:10], "r").a.id == first.id
    with pytest.raises(ckstore.SnapshotNotFoundError):
        store.diff("r@1", "nope")
