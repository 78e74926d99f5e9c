"""The data layer of the UI: what each view's JSON says, straight from a store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore.errors import InvalidInputError, SnapshotNotFoundError
from ckstore.format.manifest import Manifest
from ckstore.ui import changes, health, maintenance, storage, timeline


@pytest.fixture
def store(scenario: tuple[Path, dict[str, str]]) -> Any:
    with ckstore.open(scenario[0], create=False) as s:
        yield s


def test_overview_lists_every_snapshot_as_columns_oldest_first(store: Any) -> None:
    h = timeline.load_history(store)
    ov = timeline.overview(store, h)
    snaps = ov["snaps"]
    assert ov["runs"] == ["base", "sft", "delta"] and len(snaps["id"]) == 12
    assert snaps["t"] == sorted(snaps["t"])
    assert [ov["runs"][r] for r in snaps["run"][:5]] == ["base"] * 5
    # parents are positions: each run is a chain, each run's first snapshot has none
    assert snaps["parent"][:5] == [-1, 0, 1, 2, 3] and snaps["parent"][5] == -1
    assert set(ov["tags"]) == {"base-model", "best"}
    assert snaps["id"][ov["tags"]["base-model"]] == store.get("base@4").id


def test_forks_point_from_the_tagged_base_to_each_fine_tune(store: Any) -> None:
    h = timeline.load_history(store)
    pos = h.position()
    edges = timeline.ForkCache().edges(store, h)
    base = pos[store.get("base").id]
    got = {(e["from"], e["to"]) for e in edges}
    # sft keeps the base's frozen backbone chunks; delta stores deltas against the base's
    assert got == {(base, pos[store.get("sft@100").id]), (base, pos[store.get("delta@10").id])}


def test_run_totals_and_the_sharing_of_one_snapshot(store: Any) -> None:
    h = timeline.load_history(store)
    totals = {r["run"]: r for r in storage.run_totals(h)}
    assert totals["sft"]["snapshots"] == 4
    assert (
        totals["sft"]["new_bytes"] < totals["sft"]["logical_bytes"]
    )  # the frozen backbone is not stored again
    d = storage.snapshot_detail(store, h, "sft@100")
    assert d["ref"] == "sft@100" and d["parent_id"] is None
    shared = {s["ref"]: s for s in d["shared"]}
    assert shared["base@4"]["relation"] == "tag base-model" and shared["base@4"]["chunks"] > 0
    assert d["exclusive_chunks"] <= d["new_chunks"] and d["stored_bytes"] > 0
    with pytest.raises(SnapshotNotFoundError):
        storage.snapshot_detail(store, h, "' OR 1=1 --")


def test_compare_greys_the_frozen_backbone_and_measures_the_rest(store: Any) -> None:
    d = changes.compare(store, "base", "best", numeric=True)
    col = {c: i for i, c in enumerate(d["columns"])}
    rows = {r[col["key"]]: r for r in d["keys"]}
    assert rows["model/layers.0.attn.q.weight"][col["status"]] == "unchanged"
    assert rows["model/layers.0.attn.q.weight"][col["rel"]] is None
    head = rows["model/head.weight"]
    assert (
        head[col["status"]] == "changed" and 0 < head[col["rel"]] < 10 and head[col["max_abs"]] > 0
    )
    layers = {entry["layer"]: entry for entry in d["layers"]}
    assert layers["model/layers.0.attn.q"]["status"] == "unchanged"
    assert (
        layers["model/layers.3.mlp.2"]["status"] == "changed"
        and layers["model/layers.3.mlp.2"]["rel"] > 0
    )
    quick = changes.compare(store, "base", "best", numeric=False)
    assert quick["counts"] == d["counts"] and all(r[col["rel"]] is None for r in quick["keys"])


@pytest.mark.parametrize(
    "key, expected",
    [
        ("model/layers.3.mlp.fc1.weight", ("model/layers.3.mlp.fc1", "weight")),
        ("optim/state/0/exp_avg", ("optim/state/0", "exp_avg")),
        ("step", ("", "step")),
    ],
)
def test_layer_of(key: str, expected: tuple[str, str]) -> None:
    assert changes.layer_of(key) == expected


def test_health_of_reads_the_header_and_refuses_malformed_shapes(store: Any) -> None:
    record = store.get("sft@300").record
    h = health.health_of(record, store.repository.load_manifest(record))
    assert h is not None and h["nan"] == 3 and h["tensors"]["model/head.weight"]["nan"] == 3
    assert "model/embed.weight" in h["stale"]
    assert (
        health.health_of(
            store.get("base@0").record, store.repository.load_manifest(store.get("base@0").record)
        )
        is None
    )
    for bad in ({"tensors": []}, {"tensors": {}, "stale": "x"}, "oops"):
        m = Manifest({}, {}, {"health": bad})
        assert health.health_of(record, m) is None
    odd = Manifest({}, {}, {"health": {"tensors": {"k": {"nan": -1, "inf": True, "norm": "x"}}}})
    assert health.health_of(record, odd) is None  # counts that are not counts: not a record to show
    unmeasured = Manifest(
        {}, {}, {"health": {"stale": ["k"], "stale_base": {"id": "x", "step": 1}}}
    )
    assert health.health_of(record, unmeasured) is None  # health=False: nothing measured
    old_norm = Manifest(
        {}, {}, {"health": {"tensors": {"k": {"nan": 0, "inf": 2, "norm": None}}, "nonfinite": 2}}
    )
    assert health.health_of(record, old_norm) == {
        "tensors": {"k": {"nan": 0, "inf": 2, "norm": None}},
        "stale": [],
        "diverged": {},
        "nan": 0,
        "inf": 2,
    }
    split = {"checked": 2, "diverged": {"k": {"ranks": [3], "regions": [], "region_count": 1}}}
    apart = Manifest({}, {}, {"health": {"tensors": {}, "nonfinite": 0, "replicas": split}})
    assert health.health_of(record, apart)["diverged"] == {"k": [3]}  # type: ignore[index]
    assert store.get("sft@300").record.nonfinite == 3 and store.get("sft@400").record.nonfinite == 0
    assert store.get("sft@400").healthy is False  # finite, but its untrained backbone is stale


def test_run_health_series_and_runs_without_health(store: Any) -> None:
    h = timeline.load_history(store)
    cache = health.HealthCache()
    sft = health.run_health(store, h, cache, "sft", 200)
    assert sft["recorded"] and sft["read"] == 4
    assert [p["nan"] for p in sft["points"]] == [0, 0, 3, 0]
    assert len(sft["norms"]) == health.MAX_LAYERS and len(sft["norms"]["model/embed"]) == 4
    base = health.run_health(store, h, cache, "base", 2)
    assert not base["recorded"] and base["read"] == 2  # evenly spread, the newest in
    assert base["points"][-1]["id"] == store.get("base").id


def test_gc_preview_names_what_gc_would_drop_and_deletes_nothing(store: Any) -> None:
    h = timeline.load_history(store)
    req = maintenance.GcRequest.parse({"keep_last": "1", "grace_seconds": "0"})
    d = maintenance.gc_preview(store, h, req)
    assert sorted(d["drop_refs"]) == sorted(store.gc(keep_last=1, dry_run=True).snapshots_dropped)
    assert "base@4" not in d["drop_refs"] and "sft@400" not in d["drop_refs"]  # tagged
    assert d["command"] == "ckstore gc --keep-last 1 --grace 0s"
    assert len(store.log()) == 12


@pytest.mark.parametrize(
    "query",
    [{"keep_last": "x"}, {"keep_last": "-1"}, {"older_than": "-5"}, {"grace_seconds": "nan"}],
)
def test_gc_preview_refuses_bad_fields(query: dict[str, str]) -> None:
    with pytest.raises(InvalidInputError):
        maintenance.GcRequest.parse(query)
