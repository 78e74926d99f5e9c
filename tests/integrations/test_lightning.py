"""PyTorch Lightning with the ckstore CheckpointIO plugin, against the real library.

The scenarios are those of Lightning's own checkpoint tests (``test_model_checkpoint.py``,
``test_checkpoint_connector.py``, ``test_restore.py``): a fit into a store resumes bit-exactly
by path; what Lightning does with files (listing, the version counter, ``ckpt_path="last"``,
SLURM's ``hpc_ckpt_N``, ``save_last="link"``, ``torch.load``, ``load_from_checkpoint``) finds
the checkpoint at its path while its bytes live once, in the store; no checkpoint is ever
deleted or shadowed by another path's save; top-k removal is a store deletion whose disk comes
back within the job.
"""

from __future__ import annotations

import argparse
import copy
import enum
import multiprocessing
import os
import pathlib
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl  # noqa: E402 - in the test extra: a missing one fails, never skips
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

import ckstore
from ckstore.errors import CheckpointNotFoundError, SnapshotNotFoundError
from ckstore.integrations import pointer
from ckstore.integrations.lightning import CkstoreCheckpointIO, CkstoreInterval

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)


class Mode(enum.Enum):
    FAST = "fast"


class _Regressor(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, seed: int = 0, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.current_epoch, float(loss)))
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7),
        }


def _data() -> torch.utils.data.DataLoader[Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False
    )


def _store(tmp_path: Path) -> ckstore.Store:
    return ckstore.open(tmp_path / "store", chunk_bytes=1024, inline_bytes=64, create=True)


def _trainer(root: Path, io: Any, epochs: int, *callbacks: Any, **kw: Any) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        plugins=[io] if io is not None else [],
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
        num_sanity_val_steps=0,
        **kw,
    )


def _top2(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=root / "ckpts",
        filename="{epoch}-{step}",
        monitor="train_loss",
        mode="min",
        save_top_k=2,
    )


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def test_fit_keeps_pointer_files_and_resumes_by_path_bit_exactly(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    model = _Regressor(seed=0)
    trainer = _trainer(tmp_path, io, 3, _top2(tmp_path))
    trainer.fit(model, _data())

    # 3 epochs saved, the worst dropped by top-k: its file and its snapshot are gone
    files = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert files == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert [s.step for s in store.log("lit")] == [12, 8]
    assert sorted(store.tags()) == sorted(
        [io.tag_of(tmp_path / "ckpts" / f) for f in files] + ["lit/best"]
    )
    best = trainer.checkpoint_callback.best_model_path
    assert store.tags()["lit/best"] == store.get(io.ref(best)).id
    # the files hold no tensor bytes: the checkpoint's bytes are in the store only
    assert all((tmp_path / "ckpts" / f).stat().st_size < 4096 for f in files)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch"} <= set(
        store.get("lit@12").manifest.apps
    )
    assert store.check(read_data=True).ok

    # Lightning's own readers find the checkpoint at its path
    path = tmp_path / "ckpts" / "epoch=1-step=8.ckpt"
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 8 and loaded["hyper_parameters"]["seed"] == 0
    back = _Regressor.load_from_checkpoint(path)
    assert back.hparams.seed == 0

    resumed = _Regressor(seed=123)  # different weights: everything must come from the store
    trainer2 = _trainer(tmp_path / "again", CkstoreCheckpointIO(store, run="lit2"), 3)
    trainer2.fit(resumed, _data(), ckpt_path=str(path))
    third = [loss for epoch, loss in model.losses if epoch == 2]
    assert len(third) == 4
    assert [loss for _, loss in resumed.losses] == third  # bit-identical floats
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    # any ref of the store works too
    assert io.load_checkpoint(io.ref(path))["global_step"] == 8
    assert io.load_checkpoint("lit@12")["global_step"] == 12
    store.close()


def test_the_store_keeps_one_copy_and_topk_removal_frees_it_within_the_job(
    tmp_path: Path,
) -> None:
    """With save_top_k=1 the store holds about one checkpoint after fit, not every epoch's
    (no 6-hour grace for what the job itself removed), and no thread outlives fit."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    keep_one = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="train_loss", save_top_k=1)
    before = set(threading.enumerate())
    _trainer(tmp_path, io, 4, keep_one).fit(_Regressor(), _data())
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    assert len(store.log("lit")) == 1
    one = store.get("lit").stored_bytes()
    packs = _du(tmp_path / "store" / "packs")
    assert packs < 1.5 * one, (packs, one)
    store.close()


def test_two_folders_with_one_file_name_are_two_checkpoints(tmp_path: Path) -> None:
    """exp_a/last.ckpt and exp_b/last.ckpt: saving the second never moves or deletes the first."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    a, b = tmp_path / "exp_a" / "last.ckpt", tmp_path / "exp_b" / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(300)}}, a)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(300)}}, b)
    assert io.load_checkpoint(a)["global_step"] == 1
    assert io.load_checkpoint(b)["global_step"] == 2
    assert len(store.log("lit")) == 2 and io.tag_of(a) != io.tag_of(b)
    # saving a path again replaces its checkpoint: the snapshot it pointed to goes
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.full((300,), 3.0)}}, a)
    assert sorted(s.step for s in store.log("lit")) == [2, 3]
    io.remove_checkpoint(b)
    assert not b.exists() and [s.step for s in store.log("lit")] == [3]
    store.close()


def test_a_second_run_in_the_same_folder_gets_new_names_and_keeps_the_first(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    for _ in range(2):
        ck = ModelCheckpoint(dirpath=tmp_path / "ck", filename="model")
        _trainer(tmp_path, io, 1, ck).fit(_Regressor(), _data())
    assert sorted(os.listdir(tmp_path / "ck")) == ["model-v1.ckpt", "model.ckpt"]
    assert len(store.log("lit")) == 2
    for name in ("model.ckpt", "model-v1.ckpt"):
        assert io.load_checkpoint(tmp_path / "ck" / name)["global_step"] == 4
    store.close()


def test_last_hpc_and_link_find_what_the_store_holds(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    link = ModelCheckpoint(dirpath=tmp_path / "ck", save_last="link", save_top_k=1)
    trainer = _trainer(tmp_path, io, 2, link)
    trainer.fit(_Regressor(), _data())
    last = tmp_path / "ck" / "last.ckpt"
    assert last.is_symlink() and torch.load(last, weights_only=True)["global_step"] == 8

    again = _trainer(tmp_path, io, 3, ModelCheckpoint(dirpath=tmp_path / "ck", save_last="link"))
    again.fit(_Regressor(seed=5), _data(), ckpt_path="last")
    assert again.ckpt_path == str(last) and again.global_step == 12
    # removing a link removes the link only: the checkpoint it points to stays
    target = os.path.realpath(last)
    io.remove_checkpoint(last)
    assert not last.exists() and os.path.exists(target)
    assert io.load_checkpoint(target)["global_step"] == 12

    conn = trainer._checkpoint_connector
    first = conn.hpc_save_path(str(tmp_path))
    trainer.save_checkpoint(first)
    assert first.endswith("hpc_ckpt_1.ckpt")
    assert conn.hpc_save_path(str(tmp_path)).endswith("hpc_ckpt_2.ckpt")
    assert conn._hpc_resume_path == first
    store.close()


def test_a_missing_checkpoint_is_a_file_not_found_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found") as caught:
        _trainer(tmp_path, io, 1).fit(_Regressor(), _data(), ckpt_path=str(tmp_path / "no.ckpt"))
    assert isinstance(caught.value, CheckpointNotFoundError)
    assert isinstance(caught.value, SnapshotNotFoundError)
    store.close()


def test_checkpoints_written_before_the_switch_load_through_the_plugin(tmp_path: Path) -> None:
    plain = _trainer(tmp_path / "plain", None, 1)
    model = _Regressor()
    plain.fit(model, _data())
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    resumed = _Regressor(seed=9)
    _trainer(tmp_path, io, 2).fit(resumed, _data(), ckpt_path=str(path))
    assert resumed.losses and resumed.losses[0][0] == 1  # resumed at epoch 1
    assert io.load_checkpoint(path)["global_step"] == 4
    io.remove_checkpoint(path)  # as TorchCheckpointIO: the file goes
    assert not path.exists()
    store.close()


def test_removal_never_deletes_a_snapshot_it_did_not_write_there(tmp_path: Path) -> None:
    """A copied pointer, another store's pointer and a snapshot you tagged survive removal."""
    store, other = _store(tmp_path), ckstore.open(tmp_path / "other", create=True)
    io, io_other = CkstoreCheckpointIO(store, run="lit"), CkstoreCheckpointIO(other, run="lit")
    state = {"global_step": 1, "state_dict": {"w": torch.zeros(300)}}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    shutil.copy(tmp_path / "a.ckpt", tmp_path / "copy.ckpt")
    io.remove_checkpoint(tmp_path / "copy.ckpt")
    assert not (tmp_path / "copy.ckpt").exists() and len(store.log("lit")) == 1
    io_other.save_checkpoint(state, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")  # not this store's: the file goes, not the snapshot
    assert len(other.log("lit")) == 1
    io.save_checkpoint({**state, "global_step": 2}, tmp_path / "c.ckpt")
    store.tag(io.ref(tmp_path / "c.ckpt"), "keep-me")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert [s.step for s in store.log("lit")] == [2]  # kept by your tag; a deleted
    assert sorted(store.tags()) == ["keep-me"]
    store.close()
    other.close()


def test_a_save_that_cannot_write_its_file_leaves_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={"a": 1})
    assert store.log("lit") == [] and store.tags() == {}
    store.close()


def _load_in_child(io: CkstoreCheckpointIO, path: str) -> int:
    return int(io.load_checkpoint(path)["global_step"])


def test_the_plugin_pickles_and_reopens_its_store_in_a_spawned_worker(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 7, "state_dict": {"w": torch.zeros(300)}}, path)
    twin = copy.deepcopy(io)
    assert twin.store is store and twin.load_checkpoint(path)["global_step"] == 7
    assert pickle.loads(pickle.dumps(io)).load_checkpoint(path)["global_step"] == 7
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_load_in_child, (io, path)) == 7
    store.close()


def test_every_installed_lightning_takes_the_plugin(tmp_path: Path) -> None:
    """The unified ``lightning`` package and ``pytorch_lightning`` each accept it as theirs."""
    import importlib
    import importlib.util

    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store)
    checked = 0
    for package in ("lightning.fabric", "lightning_fabric"):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            continue
        module = importlib.import_module(f"{package}.plugins.io.torch_io")
        assert isinstance(io, module.TorchCheckpointIO) and isinstance(io, module.CheckpointIO)
        checked += 1
    assert checked >= 1
    trainer = pl.Trainer(plugins=[io], logger=False, accelerator="cpu")
    assert trainer.strategy.checkpoint_io is io
    store.close()


def test_default_trainers_snapshots_are_healthy_and_hparams_come_back(tmp_path: Path) -> None:
    """ModelCheckpoint's inf sentinels are not a divergence; paths, namespaces and enum members
    in hyper-parameters are stored as data and load back as what they were."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    model = _Regressor(
        data=pathlib.Path("/data/x"), args=argparse.Namespace(lr=0.1), mode=Mode.FAST
    )
    trainer = _trainer(tmp_path, io, 2)
    trainer.fit(model, _data())
    assert all(s.healthy for s in store.log("lit"))
    assert store.get("lit@healthy").step == 8
    back = _Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    assert back.hparams.data == pathlib.Path("/data/x") and back.hparams.mode is Mode.FAST
    assert back.hparams.args == argparse.Namespace(lr=0.1)
    store.close()


def test_the_pointer_file_is_what_torch_load_reads(tmp_path: Path) -> None:
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.arange(300.0)}}, path)
    found = pointer.read_file(str(path))
    assert found is not None and found.path == str(path) and found.values == "lightning"
    assert found.snapshot == store.get(io.ref(path)).id
    store.close()


def test_the_interval_callback_saves_when_a_take_is_due(tmp_path: Path) -> None:
    """CkstoreInterval asks its TakeInterval after every batch and saves through the plugin
    when it says so (pinned here to every 3 steps: the costs it measures do not matter); each
    save leaves a pointer file at its path."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    every = ckstore.TakeInterval(start=3, min_steps=3, max_steps=3)
    ckpts = tmp_path / "ckpts"
    trainer = _trainer(
        tmp_path, io, 2, CkstoreInterval(every, dirpath=ckpts), enable_checkpointing=False
    )  # 4 batches an epoch: 8 steps
    trainer.fit(_Regressor(seed=0), _data())
    assert [s.step for s in store.log("lit")] == [6, 3]
    paths = [ckpts / "interval-3.ckpt", ckpts / "interval-6.ckpt"]
    assert sorted(store.tags()) == sorted(io.tag_of(p) for p in paths)
    assert sorted(ckpts.iterdir()) == paths
    assert all(pointer.read_file(str(p)) is not None for p in paths)
    assert io.load_checkpoint(paths[1])["global_step"] == 6
    assert every.state()["takes"] == 2
    store.close()


@pytest.mark.parametrize("by", ["path", "ref"])
def test_the_checkpoint_a_fit_resumed_from_is_kept_by_path_and_by_ref(
    tmp_path: Path, by: str
) -> None:
    """Lightning never removes the checkpoint the Trainer resumed from (it compares
    ``trainer.ckpt_path`` with the file it drops). Resumed by a ref (``io.ref(path)``, which the
    docs offer), that comparison never matched, and top-k removal deleted the snapshot the job
    resumed from; now the plugin keeps it, file and snapshot, as by its path."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    latest = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=1)  # the newest only
    _trainer(tmp_path, io, 2, latest).fit(_Regressor(), _data())
    first = tmp_path / "ck" / "epoch=1-step=8.ckpt"
    sid = store.get(io.ref(first)).id
    again = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=1)
    resume_from = str(first) if by == "path" else io.ref(first)
    _trainer(tmp_path, io, 3, again).fit(_Regressor(), _data(), ckpt_path=resume_from)
    try:
        assert first.exists()
        assert store.get(sid, None) is not None, "the snapshot resumed from was deleted"
        assert io.load_checkpoint(first)["global_step"] == 8
    finally:
        store.close()


def test_a_tag_of_yours_named_like_the_best_tag_keeps_its_snapshot(tmp_path: Path) -> None:
    """ "A tag of yours keeps a snapshot", whatever its name: one that starts with
    ``<run>/best`` (``lit/best-phase1``, the best of an earlier phase) was taken for one of the
    plugin's own best tags, untagged, and its snapshot deleted at the file's removal."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    path = tmp_path / "ck" / "epoch=1.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(300)}}, path)
    store.tag(io.ref(path), "lit/best-phase1")
    io.remove_checkpoint(path)
    try:
        assert not path.exists()
        assert store.get("lit/best-phase1").step == 1
    finally:
        store.close()


def test_the_plugins_own_best_tags_of_several_monitors_go_with_the_checkpoint(
    tmp_path: Path,
) -> None:
    """With two monitored ModelCheckpoints the best tags are ``<run>/best-<monitor>``; the save
    records their names, so a removal still untags them (and deletes the snapshot)."""
    store = _store(tmp_path)
    io = CkstoreCheckpointIO(store, run="lit")
    path = tmp_path / "ck" / "epoch=1.ckpt"
    callbacks = {
        f"ModelCheckpoint{{'monitor': '{m}'}}": {
            "monitor": m,
            "best_k_models": {str(path): 0.5},
            "best_model_path": str(path),
        }
        for m in ("val/loss", "val/acc")
    }
    io.save_checkpoint(
        {"global_step": 1, "state_dict": {"w": torch.ones(300)}, "callbacks": callbacks}, path
    )
    sid = store.get(io.ref(path)).id
    assert {t for t, s in store.tags().items() if s == sid} >= {
        "lit/best-val_loss",
        "lit/best-val_acc",
    }
    io.remove_checkpoint(path)
    try:
        assert store.get(sid, None) is None
        assert not any(t.startswith("lit/best") for t in store.tags())
    finally:
        store.close()
