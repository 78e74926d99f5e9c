"""The data layer of the UI: what each view's JSON says, straight from a store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore.errors import InvalidInputError, SnapshotNotFoundError
from ckstore.format.manifest import Manifest
from ckstore.ui import changes, health, maintenance, storage, timeline
from tests.ui.scenario import RUNS


@pytest.fixture
def store(scenario: tuple[Path, dict[str, str]]) -> Any:
    with ckstore.open(scenario[0], create=False) as s:
        yield s


def test_overview_lists_every_snapshot_as_columns_oldest_first(store: Any) -> None:
    h = timeline.load_history(store)
    ov = timeline.overview(store, h)
    snaps = ov["snaps"]
    assert ov["runs"] == list(RUNS) and len(snaps["id"]) == 23
    assert snaps["t"] == sorted(snaps["t"])
    assert [ov["runs"][r] for r in snaps["run"][:4]] == ["pretrain"] * 4
    # parents are positions: each run is a chain, each run's first snapshot has none
    assert snaps["parent"][:4] == [-1, 0, 1, 2] and snaps["parent"][4] == -1
    assert set(ov["tags"]) == {"base", "best"}
    assert snaps["id"][ov["tags"]["base"]] == store.get("pretrain@30").id
    # what each take found, from the index: the lineage marks it without reading a manifest
    pos = h.position()
    assert snaps["nonfinite"][pos[store.get("diverged@300").id]] == 3
    assert snaps["stale"][pos[store.get("stuck@1").id]] > 0
    assert snaps["diverged"][pos[store.get("stuck@1").id]] in (0, None)  # one process: none
    assert store.get("stuck@1").healthy is False  # finite, but a tensor that should train is stale
    assert snaps["nonfinite"][pos[store.get("legacy@0").id]] is None  # not recorded


def test_the_header_names_the_store_without_its_folder(tmp_path: Path) -> None:
    inside = str(tmp_path / "ckpts")
    assert timeline.shown_url(inside, str(tmp_path)) == "ckpts"
    assert timeline.shown_url("s3://bucket/ckpts") == "s3://bucket/ckpts"
    home = os.path.expanduser("~")
    assert timeline.shown_url(home + "/runs/ckpts", "/elsewhere") == "~/runs/ckpts"
    assert timeline.shown_url("/srv/ckpts", "/elsewhere") == "/srv/ckpts"


def test_forks_point_from_the_tagged_base_to_each_fine_tune(store: Any) -> None:
    h = timeline.load_history(store)
    pos = h.position()
    edges = {e["to"]: e for e in timeline.ForkCache().edges(store, h)}
    base = pos[store.get("base").id]

    def source(run: str) -> tuple[int, bool]:
        e = edges[pos[store.log(run)[-1].id]]
        return e["from"], e["recorded"]

    # restored from the base: recorded by the take (sft-full shares no chunk with it)
    assert source("sft-frozen") == (base, True)
    assert source("sft-full") == (base, True)
    assert source("diverged") == (base, True)
    # loaded by hand: found from the delta bases, and from the backbone chunks the base and
    # every sft-frozen snapshot hold alike (the earliest holder, never a later fine-tune)
    assert source("lora-delta") == (base, False)
    assert source("stuck") == (base, False)
    assert pos[store.log("legacy")[-1].id] not in edges


def test_a_fork_tie_goes_to_the_earliest_holder_never_back_in_step(store: Any) -> None:
    root = store.get("stuck@0")
    holders = store.fork_sources([root.id])[root.id]
    best = max(h.chunks for h in holders)
    tied = {store.get(h.snapshot_id).ref.split(" ")[0] for h in holders if h.chunks == best}
    assert {"pretrain@30", "sft-frozen@300"} <= tied  # the tagged fine-tune shares as much
    h = timeline.load_history(store)
    edge = next(
        e for e in timeline.fork_edges(store, h, h.roots()) if e["to"] == h.position()[root.id]
    )
    assert h.records[edge["from"]].id == store.get("base").id


def test_run_totals_and_the_sharing_of_one_snapshot(store: Any) -> None:
    h = timeline.load_history(store)
    totals = {r["run"]: r for r in storage.run_totals(h)}
    assert totals["sft-frozen"]["snapshots"] == 4
    assert (
        totals["sft-frozen"]["new_bytes"] < totals["sft-frozen"]["logical_bytes"]
    )  # the frozen backbone is not stored again
    d = storage.snapshot_detail(store, h, "sft-frozen@100")
    assert d["ref"] == "sft-frozen@100" and d["parent_id"] is None
    assert d["forked_from"] == {"id": store.get("base").id, "ref": "pretrain@30"}
    shared = {s["ref"]: s for s in d["shared"]}
    assert shared["pretrain@30"]["relation"] == "tag base" and shared["pretrain@30"]["chunks"] > 0
    assert d["exclusive_chunks"] <= d["new_chunks"] and d["stored_bytes"] > 0
    nan = storage.snapshot_detail(store, h, "diverged@300")
    assert nan["nonfinite"] == 3 and nan["stale"] == 0
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


def test_a_nan_tensor_changes_by_nan_not_by_infinity(store: Any) -> None:
    d = changes.compare(store, "diverged@200", "diverged@300", numeric=True)
    col = {c: i for i, c in enumerate(d["columns"])}
    rows = {r[col["key"]]: r for r in d["keys"]}
    assert rows["model/layers.3.mlp.0.weight"][col["rel"]] == "nan"
    assert isinstance(rows["model/layers.3.mlp.2.weight"][col["rel"]], float)
    layer = next(e for e in d["layers"] if e["layer"] == "model/layers.3.mlp.0")
    assert layer["rel"] == "nan"


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
    record = store.get("diverged@300").record
    h = health.health_of(record, store.repository.load_manifest(record))
    assert (
        h is not None and h["nan"] == 3 and h["tensors"]["model/layers.3.mlp.0.weight"]["nan"] == 3
    )
    stuck = store.get("stuck@1").record
    assert (
        "model/head.weight"
        in health.health_of(stuck, store.repository.load_manifest(stuck))["stale"]
    )  # type: ignore[index]
    legacy = store.get("legacy@0").record
    assert health.health_of(legacy, store.repository.load_manifest(legacy)) is None
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
    assert store.get("diverged@300").record.nonfinite == 3 and store.get("diverged@200").healthy
    split = {"checked": 2, "diverged": {"k": {"ranks": [3], "regions": [], "region_count": 1}}}
    apart = Manifest({}, {}, {"health": {"tensors": {}, "nonfinite": 0, "replicas": split}})
    assert health.health_of(record, apart)["diverged"] == {"k": [3]}  # type: ignore[index]


def test_run_health_plots_the_model_with_its_nan_layers_and_no_counters(store: Any) -> None:
    h = timeline.load_history(store)
    cache = health.HealthCache()
    run = health.run_health(store, h, cache, "diverged", 200)
    assert run["recorded"] and run["read"] == 4 and run["app"] == "model"
    assert run["apps"] == ["model", "optim"]
    assert [p["nan"] for p in run["points"]][:3] == [0, 0, 3]
    assert len(run["norms"]) == health.MAX_LAYERS and len(run["norms"]["model/embed"]) == 4
    assert all(layer.startswith("model/") for layer in run["norms"])  # not optim/state/<n>
    assert run["nonfinite"]["model/layers.3.mlp.0"] == [2, 3]  # plotted, however small its norm
    assert len(run["nonfinite"]) == 8  # by step 400 every MLP weight
    every = health.run_health(store, h, cache, "pretrain", 200, app=health.ALL_APPS)
    optim = health.run_health(store, h, cache, "pretrain", 200, app="optim")
    assert optim["norms"] and not any(k.endswith("/step") for k in every["norms"])
    assert all(layer.startswith("optim/state/") for layer in optim["norms"])
    legacy = health.run_health(store, h, cache, "legacy", 200)
    assert not legacy["recorded"] and legacy["read"] == 2
    assert legacy["points"][-1]["id"] == store.get("legacy").id
    assert health.pick(list(range(10)), 3) == [0, 4, 9]  # type: ignore[arg-type]  # evenly spread, the newest in
    assert health.default_app(["optim", "net"]) == "net" and health.default_app([]) == "*"


def test_gc_preview_names_what_gc_would_drop_and_deletes_nothing(store: Any) -> None:
    h = timeline.load_history(store)
    req = maintenance.GcRequest.parse({"keep_last": "1", "grace_seconds": "0"})
    d = maintenance.gc_preview(store, h, req)
    assert sorted(d["drop_refs"]) == sorted(store.gc(keep_last=1, dry_run=True).snapshots_dropped)
    assert "sft-frozen@300" not in d["drop_refs"]  # tagged
    assert d["command"] == "ckstore gc --keep-last 1 --grace 0s"
    best = maintenance.GcRequest.parse({"keep_best": "2", "metric": "loss", "runs": "sft-full"})
    d = maintenance.gc_preview(store, h, best)
    assert d["drop_refs"] == ["sft-full@100"]  # losses 1.8, 1.2, 0.9: the two lowest stay
    assert d["command"] == "ckstore gc --keep-best 2 --metric loss --run sft-full"
    assert len(store.log()) == 23


@pytest.mark.parametrize(
    "query",
    [
        {"keep_last": "x"},
        {"keep_last": "-1"},
        {"older_than": "-5"},
        {"grace_seconds": "nan"},
        {"keep_best": "2"},
        {"keep_best": "2", "metric": "loss", "mode": "up"},
    ],
)
def test_gc_preview_refuses_bad_fields(query: dict[str, str]) -> None:
    with pytest.raises(InvalidInputError):
        maintenance.GcRequest.parse(query)
