"""The TorchSnapshot-compatible surface: Snapshot.take/restore/async_take/read_object/get_manifest."""

from __future__ import annotations

import threading

import pytest
import torch

import ckstore
from ckstore import Snapshot


def _app():
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    return {"model": model, "progress": ckstore.StateDict(step=5)}


def test_take_and_restore_by_path_makes_a_store_of_its_own(tmp_path):
    path = tmp_path / "run1" / "final"  # not step-like (see test_open_rules for step_N paths)
    app = _app()
    Snapshot.take(path=str(path), app_state=app)
    assert (path / "ckstore.json").exists()
    dest = {"model": torch.nn.Linear(30, 20), "progress": ckstore.StateDict()}
    Snapshot(path=str(path)).restore(app_state=dest)
    assert torch.equal(dest["model"].weight, app["model"].weight) and dest["progress"]["step"] == 5
    manifest = Snapshot(
        path=str(path)
    ).get_manifest()  # TorchSnapshot's logical paths: <rank>/<key>
    assert manifest["0/model/weight"].kind == "tensor" and manifest["0/model/weight"].shape == (
        20,
        30,
    )
    assert (
        manifest["0/model/weight"].nbytes == 20 * 30 * 4
        and manifest["0/progress/step"].kind == "value"
    )
    assert torch.equal(Snapshot(path=str(path)).read_object("0/model/weight"), app["model"].weight)
    out = torch.empty(20)
    assert Snapshot(path=str(path)).read_object("0/model/bias", obj_out=out) is out
    assert torch.equal(out, app["model"].bias)


def test_paths_inside_an_existing_store_join_it_and_dedup(tmp_path):
    ckstore.open(tmp_path / "ckpts", chunk_bytes=1024, create=True).close()
    app = _app()
    first = Snapshot.take(path=str(tmp_path / "ckpts" / "run1" / "step_100"), app_state=app)
    app["progress"]["step"] = 6
    second = Snapshot.take(path=str(tmp_path / "ckpts" / "run1" / "step_200"), app_state=app)
    assert first.stats["new_chunks"] > 0 and second.stats["new_chunks"] == 0
    assert not (tmp_path / "ckpts" / "run1").exists()  # names live in the index, not as dirs
    dest = {"progress": ckstore.StateDict()}
    Snapshot(path=str(tmp_path / "ckpts" / "run1" / "step_100")).restore(dest)
    assert dest["progress"]["step"] == 5
    with pytest.raises(ckstore.ConflictError):
        Snapshot.take(path=str(tmp_path / "ckpts" / "run1" / "step_100"), app_state=app)
    lazy = Snapshot(path=str(tmp_path / "ckpts" / "run1" / "step_300"))  # lazy: nothing opened yet
    with pytest.raises(ckstore.SnapshotNotFoundError):
        lazy.get_manifest()


def test_missing_path_is_not_found_on_first_use(tmp_path):
    snap = Snapshot(path=str(tmp_path / "nothing"))
    assert "not opened" in repr(snap)
    with pytest.raises(ckstore.SnapshotNotFoundError):
        snap.restore({"s": ckstore.StateDict()})
    assert not (tmp_path / "nothing").exists()


def test_async_take_holds_the_state_at_call_time(store):
    state = ckstore.StateDict({"w": torch.zeros(256, 64), "step": 1, "cfg": {"lr": 0.1}})
    pending = store.async_take({"s": state}, run="r", step=1)
    state["w"].add_(1.0)  # training continues and mutates everything right away
    state["step"] = 2
    state["cfg"]["lr"] = 0.2
    snap = pending.wait(timeout=60)
    assert pending.done()
    got = snap.read_object("s")
    assert (
        torch.equal(got["w"], torch.zeros(256, 64))
        and got["step"] == 1
        and got["cfg"] == {"lr": 0.1}
    )


def test_async_take_surfaces_errors_from_wait(store):
    store.take({"s": ckstore.StateDict(a=1)}, run="r", name="taken")
    pending = store.async_take({"s": ckstore.StateDict(a=2)}, run="r", name="taken")
    with pytest.raises(ckstore.ConflictError):
        pending.wait(timeout=60)


def test_snapshot_async_take_by_path(tmp_path):
    app = _app()
    pending = Snapshot.async_take(path=str(tmp_path / "s"), app_state=app)
    with torch.no_grad():
        app["model"].weight.zero_()
    snap = pending.wait()
    assert not torch.equal(snap.read_object("0/model/weight"), torch.zeros(20, 30))
    assert snap.ranked_paths and torch.equal(
        snap.with_ranked_paths(False).read_object("model/weight"),
        snap.read_object("0/model/weight"),
    )


def test_concurrent_takes_from_threads(store):
    errors = []

    def work(i):
        try:
            store.take({"s": ckstore.StateDict(w=torch.full((64, 64), float(i)))}, run=f"t{i}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for i in range(4):
        assert torch.equal(store.get(f"t{i}").read_object("s/w"), torch.full((64, 64), float(i)))
