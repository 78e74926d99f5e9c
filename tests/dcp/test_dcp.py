"""ckstore as a DCP storage backend: torch.distributed.checkpoint.save/load into a store.

A plain process saves model + optimizer state and loads it back; 4 real gloo ranks (fork)
save DTensor Shard(0) state and 2 ranks load it as Shard(1) and Replicate, bit-exact. A
second save of unchanged state writes no chunk bytes, and nothing stored is pickle.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp  # noqa: E402  (ships with the torch we pin)

import ckstore
from ckstore.dcp import StorageReader, StorageWriter, metadata_from_json, metadata_to_json
from ckstore.errors import UnsupportedValueError
from tests.dcp import scenarios as ds
from tests.support.ranks import run_ranks, values
from tests.support.states import bits

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m, o = _model()
    for _ in range(2):
        m(torch.randn(3, 40)).sum().backward()
        o.step()
    return m, o


def _no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle used while loading")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_single_process_model_and_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    m, o = _trained()
    msd, osd = get_state_dict(m, o)
    state = {
        "model": msd,
        "optim": osd,
        "extra": {"epoch": 3, "name": "run-a", "loss": float("nan")},
    }
    w1 = StorageWriter(store, run="sp", step=1, tags=("best",), metadata={"who": "test"})
    dcp.save(state, storage_writer=w1)
    first = w1.snapshot.record
    assert first.new_chunks > 0 and first.new_bytes > 0 and first.world_size == 1
    packs = store.repository.objects.list_packs()

    w2 = StorageWriter(store, run="sp", step=2)
    dcp.save(state, storage_writer=w2)
    second = w2.snapshot.record
    assert (second.new_bytes, second.new_chunks) == (0, 0)
    assert second.reused_chunks == first.new_chunks + first.reused_chunks
    assert store.repository.objects.list_packs() == packs  # not one byte of chunk data written
    assert store.repository.index.snapshot_chunk_ids(
        first.id
    ) == store.repository.index.snapshot_chunk_ids(second.id)
    assert not store.repository.index.live_sessions()
    assert store.tags()["best"] == first.id and store.get("sp@1").record.metadata == {"who": "test"}
    assert store.check(read_data=True).ok

    m2, o2 = _model()
    msd2, osd2 = get_state_dict(m2, o2)
    dest = {"model": msd2, "optim": osd2, "extra": {"epoch": -1, "name": "", "loss": 0.0}}
    _no_pickle(monkeypatch)
    dcp.load(dest, storage_reader=StorageReader(store, "sp@1"))
    monkeypatch.undo()
    set_state_dict(m2, o2, model_state_dict=dest["model"], optim_state_dict=dest["optim"])
    for k, v in m.state_dict().items():
        assert bits(v) == bits(m2.state_dict()[k]), k
    want, got = o.state_dict(), o2.state_dict()
    for pid, st in want["state"].items():
        for k, v in st.items():
            assert bits(v) == bits(got["state"][pid][k]), (pid, k)
    assert got["param_groups"] == want["param_groups"]
    assert dest["extra"]["epoch"] == 3 and dest["extra"]["name"] == "run-a"
    assert dest["extra"]["loss"] != dest["extra"]["loss"]  # NaN kept
    store.close()


def test_stored_metadata_is_json(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    m, o = _trained()
    state = {"model": m.state_dict(), "step": 7}
    w = StorageWriter(store, run="js")
    returned = dcp.save(state, storage_writer=w)
    raw = store.repository.objects.get_blob("manifests", w.snapshot.record.manifest_id)
    doc = json.loads(raw)  # the manifest (which carries DCP's metadata) is plain JSON
    assert not raw.startswith(b"\x80")
    dcp_doc = doc["snapshot"]["dcp"]
    assert dcp_doc["format"] == "ckstore/dcp-metadata" and dcp_doc["version"] == 1
    back = metadata_from_json(json.loads(json.dumps(dcp_doc)))
    assert back.state_dict_metadata == returned.state_dict_metadata
    assert back.planner_data == returned.planner_data
    assert back.storage_data == returned.storage_data
    # the manifest mirrors every DCP key: tensors of their real dtype/shape, values inline
    snap = store.get("js")
    assert snap.read_object("dcp/step") == 7
    assert bits(snap.read_object("dcp/model.0.weight")) == bits(m.state_dict()["0.weight"])
    store.close()


def test_ckstore_restore_and_read_object_of_a_dcp_snapshot(tmp_path: Path) -> None:
    """A dcp.save read back with ckstore's own restore: each app's state dict is mapped onto
    DCP's keys (model.0.weight -> dcp/model.0.weight); BytesIO values come back as BytesIO."""
    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    m, o = _trained()
    state = {
        "model": m.state_dict(),
        "optim": o.state_dict(),
        "train": ds.TrainState(3, [1.5, 0.5]),
    }
    dcp.save(state, storage_writer=StorageWriter(store, run="d", step=1))
    m2, o2 = _model()
    m2(torch.randn(3, 40)).sum().backward()
    o2.step()  # optimizer state exists, as DCP itself needs for loading
    train = ds.TrainState()
    store.get("d@1").restore({"model": m2, "optim": o2, "train": train})
    for k, v in m.state_dict().items():
        assert bits(v) == bits(m2.state_dict()[k]), k
    for pid, st in o.state_dict()["state"].items():
        for k, v in st.items():
            assert bits(v) == bits(o2.state_dict()["state"][pid][k]), (pid, k)
    assert (train.step, train.losses) == (3, [1.5, 0.5])
    with pytest.raises(
        ckstore.MismatchError, match="no DCP key"
    ):  # strict: a tensor DCP never saved
        store.get("d@1").restore({"model": torch.nn.Linear(2, 2)})
    snap = store.get("d@1")
    assert bits(snap.read_object("dcp/model.0.weight")) == bits(m.state_dict()["0.weight"])
    losses = snap.read_object("dcp/train.losses")
    assert torch.load(losses, weights_only=True) == [1.5, 0.5]
    assert ckstore.Snapshot.of(snap).read_object("0/dcp/train.step") == torch.tensor(3)
    store.close()


def test_overwrite_false_refuses_an_existing_target(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    state = {"t": torch.arange(600.0)}
    dcp.save(state, storage_writer=StorageWriter(store, run="o", step=1, overwrite=False))
    with pytest.raises(BaseException, match="already exists") as info:
        dcp.save(state, storage_writer=StorageWriter(store, run="o", step=1, overwrite=False))
    assert "ConflictError" in str(info.value)
    dcp.save(
        state, storage_writer=StorageWriter(store, run="o", step=2, overwrite=False)
    )  # another step: fine
    dcp.save(
        state, storage_writer=StorageWriter(store, run="o", step=1)
    )  # overwrite=True: a newer one
    assert [s.step for s in store.log("o")] == [1, 2, 1]
    dcp.save(state, storage_writer=StorageWriter(store, run="n", name="ckpt-a", overwrite=False))
    with pytest.raises(BaseException, match="'ckpt-a' already exists"):
        dcp.save(
            state, storage_writer=StorageWriter(store, run="other", name="ckpt-a", overwrite=False)
        )
    with pytest.raises(BaseException, match="already exists"):  # no step: any snapshot of the run
        dcp.save(state, storage_writer=StorageWriter(store, run="o", overwrite=False))
    store.close()


def test_writer_and_reader_pickle_and_reopen_lazily(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    writer = pickle.loads(pickle.dumps(StorageWriter(store, run="pk", step=1, overwrite=False)))
    assert writer.overwrite is False and writer._ref._store is None  # nothing open until used
    dcp.save({"t": torch.arange(600.0)}, storage_writer=writer)
    assert writer.snapshot.run == "pk"
    again = pickle.loads(pickle.dumps(writer))  # after a save too: leases and store stay behind
    assert again.snapshot is None and again._held == []
    reader = pickle.loads(pickle.dumps(StorageReader(store, "pk@1")))
    dest = {"t": torch.zeros(600)}
    dcp.load(dest, storage_reader=reader)
    assert torch.equal(dest["t"], torch.arange(600.0))
    store.close()


def test_planner_data_that_is_not_json_is_refused() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(UnsupportedValueError, match="planner_data"):
        metadata_to_json(Metadata(state_dict_metadata={}, planner_data={"x": object()}))


def test_checkpoint_id_names_run_and_step(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", **ds.TINY, create=True)
    w = StorageWriter(store, run="ignored")
    dcp.save({"t": torch.arange(600.0)}, storage_writer=w, checkpoint_id="named@12")
    assert (w.snapshot.run, w.snapshot.step) == ("named", 12)
    dest = {"t": torch.zeros(600)}
    dcp.load(dest, storage_reader=StorageReader(store, "nothing"), checkpoint_id="named@12")
    assert torch.equal(dest["t"], torch.arange(600.0))
    store.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Save Shard(0) state with 4 ranks (twice), then load it with 2 ranks in other placements."""
    tmp = tmp_path_factory.mktemp("dcp")
    path = str(tmp / "store")
    for p in (
        path,
        path + "-gc",
    ):  # made here: ranks opening a fresh store at once race on its schema
        ckstore.open(p, **ds.TINY, create=True).close()
    saved = values(run_ranks(ds.save_twice, 4, tmp, path, "d4"))
    loads = [["d4@1", "shard1"], ["d4@2", "replicate"]]
    loaded = values(run_ranks(ds.load_each, 2, tmp, path, loads))
    return {"path": path, "saved": saved, "loaded": loaded}


def test_four_ranks_save_one_snapshot(ranks: dict[str, Any]) -> None:
    first = ranks["saved"][0]["1"]
    assert first["world"] == 4 and first["new_chunks"] > 0
    assert all("1" not in r for r in ranks["saved"][1:])  # only the coordinator commits
    with ckstore.open(ranks["path"], create=True) as store:
        assert store.get("d4@1").id == first["id"]
        assert store.check(read_data=True).ok
        assert not store.repository.index.live_sessions()


def test_second_save_of_unchanged_state_writes_no_chunk_bytes(ranks: dict[str, Any]) -> None:
    second = ranks["saved"][0]["2"]
    assert (second["new_bytes"], second["new_chunks"]) == (0, 0)
    with ckstore.open(ranks["path"], create=True) as store:
        assert store.repository.index.snapshot_chunk_ids(
            second["id"]
        ) == store.repository.index.snapshot_chunk_ids(ranks["saved"][0]["1"]["id"])


def test_two_ranks_load_with_other_placements(ranks: dict[str, Any]) -> None:
    # each rank checked its shards bit by bit (with pickle.load/loads disabled)
    for per_rank in ranks["loaded"]:
        assert per_rank == [{"epoch": 5, "cfg": {"lr": 0.1, "name": "x"}}] * 2


def test_failed_save_commits_nothing_and_leaves_no_session(ranks: dict[str, Any]) -> None:
    for r in ranks["saved"]:
        assert "key 'bad'" in r["failed"] and "never pickles" in r["failed"]
        assert r["live_sessions"] == 0
    with ckstore.open(ranks["path"], create=True) as store:
        assert [s.step for s in store.log("d4")] == [2, 1]


def test_coordinator_pins_everything_until_it_commits(ranks: dict[str, Any]) -> None:
    gc = ranks["saved"][0]["gc"]
    assert all(r["gc"] is None for r in ranks["saved"][1:])
    # in finish: the other ranks' sessions are over, yet no chunk is unprotected and gc(grace 0) prunes none
    assert gc["chunks"] > 0 and gc["unprotected"] == 0 and gc["removed"] == 0
    assert gc["live_sessions"] == 1  # the coordinator's
    assert gc["check"]


def test_two_ranks_overwrite_false_bytesio_and_both_async_executors(tmp_path: Path) -> None:
    """2 ranks: overwrite=False refuses on every rank; a BytesIO loss history round-trips;
    dcp.async_save commits with the thread executor (writer given a URL) and with the process
    executor (the writer, holding an open store, is pickled into DCP's checkpoint process)."""
    path = str(tmp_path / "store")
    ckstore.open(path, **ds.TINY, create=True).close()
    for r in values(run_ranks(ds.parity, 2, tmp_path, path, timeout=180)):
        assert "ConflictError" in r["refused"] and "overwrite=False" in r["refused"], r["refused"][
            :300
        ]
        assert r["loaded"] == [7, [0.5, 0.25], True]
        assert r["async"] == [[0.5, 0.25, 2.0, 3.0], True]
        assert r["steps"] == [1, 2, 3]  # the refused save committed nothing


def test_plain_process_loads_the_four_rank_save_after_gc(
    ranks: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with ckstore.open(ranks["path"], create=True) as store:
        store.gc(grace_seconds=0)
        dest = {
            "g": {k: torch.zeros_like(v) for k, v in ds.global_state().items()},
            "epoch": 0,
            "cfg": {"lr": 0.0, "name": ""},
        }
        _no_pickle(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(dest, storage_reader=StorageReader(store, "d4@1"))
        monkeypatch.undo()
        ds.check(dest["g"])
        assert dest["epoch"] == 5


def test_dcp_save_on_a_sub_group(tmp_path: Path) -> None:
    """Only ranks {0, 2} of 4 dcp.save (process_group=); ranks {1, 3} take something else on
    their own sub-group meanwhile. Each is one snapshot of 2 ranks, loaded back bit-exactly."""
    path = str(tmp_path / "store")
    ckstore.open(path, **ds.TINY, create=True).close()
    res = values(run_ranks(ds.subgroup_saves, 4, tmp_path, path, timeout=180))
    assert res[0]["world"] == 2 and res[0]["id"] and res[2]["id"] is None  # rank 0 coordinates
    assert res[1]["id"] == res[3]["id"] and res[1]["world"] == 2
    with ckstore.open(path) as store:
        snap = store.get("sub02")
        assert snap.id == res[0]["id"]
        for k, t in ds.global_state().items():
            if k != "plain":
                assert bits(snap.read_object(f"dcp/g.{k}")) == bits(t), k
        assert [int(t[0, 0]) for t in store.get("sub13").read_object("s/x")] == [1, 3]  # per rank
        assert store.check(read_data=True).ok
