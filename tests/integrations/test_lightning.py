"""PyTorch Lightning with the ckstore CheckpointIO plugin, against the real library.

A ``Trainer.fit`` checkpoints 3 epochs into a store through ``Trainer(plugins=[...])``;
``ModelCheckpoint``'s top-k removal deletes the dropped snapshot (gc reclaims it); a new
Trainer resumes from the checkpoint after epoch 2 and its third epoch has exactly the losses
of the uninterrupted run. No ``.ckpt`` file is ever written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl  # noqa: E402 - in the test extra: a missing one fails, never skips
import torch

import ckstore
from ckstore.integrations.lightning import CkstoreCheckpointIO, CkstoreInterval

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _Regressor(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, seed: int) -> None:
        super().__init__()
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


def _trainer(tmp: Path, io: CkstoreCheckpointIO, epochs: int) -> Any:
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp / "ckpts",
        filename="{epoch}-{step}",
        monitor="train_loss",
        mode="min",
        save_top_k=2,
    )
    return pl.Trainer(
        max_epochs=epochs,
        plugins=[io],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp,
        num_sanity_val_steps=0,
    )


def test_fit_checkpoints_into_store_and_resumes_with_identical_loss(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", chunk_bytes=1024, inline_bytes=64, create=True)
    io = CkstoreCheckpointIO(store, run="lit")
    model = _Regressor(seed=0)
    trainer = _trainer(tmp_path, io, epochs=3)
    trainer.fit(model, _data())

    # 3 epochs saved, the worst dropped by top-k: a ckstore delete, no file anywhere
    assert not list(tmp_path.rglob("*.ckpt"))
    snaps = store.log("lit")
    assert [s.step for s in snaps] == [12, 8]
    assert sorted(store.tags()) == ["lit/epoch_1-step_8.ckpt", "lit/epoch_2-step_12.ckpt"]
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch", "global_step"} <= {
        k.split("/", 1)[0] for k in snaps[0].get_manifest()
    }
    reclaimed = store.gc(grace_seconds=0)
    assert reclaimed.chunks_removed > 0  # the deleted epoch's own chunks
    assert store.check(read_data=True).ok

    # resume from the checkpoint after epoch 2, saved at the path ModelCheckpoint chose
    best_path = str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt")
    resumed = _Regressor(seed=123)  # different weights: everything must come from the store
    trainer2 = _trainer(tmp_path / "again", CkstoreCheckpointIO(store, run="lit2"), epochs=3)
    trainer2.fit(
        resumed, _data(), ckpt_path=str(CkstoreCheckpointIO(store, run="lit").ref(best_path))
    )
    third = [loss for epoch, loss in model.losses if epoch == 2]
    assert len(third) == 4
    assert [loss for _, loss in resumed.losses] == third  # bit-identical floats
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    # a path given directly works too, and an unknown one names the run to look in
    assert io.load_checkpoint(best_path)["global_step"] == 8
    with pytest.raises(ckstore.SnapshotNotFoundError, match="ckstore log --run lit"):
        io.load_checkpoint(tmp_path / "nope.ckpt")


def test_remove_checkpoint_keeps_a_snapshot_you_tagged(tmp_path: Path) -> None:
    """Top-k removal deletes the path's snapshot, but a tag of yours (e.g. best) keeps it."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=1024, inline_bytes=64, create=True)
    io = CkstoreCheckpointIO(store, run="lit")
    for step in (1, 2):
        io.save_checkpoint(
            {"global_step": step, "w": torch.full((64,), float(step))}, f"s{step}.ckpt"
        )
    store.tag(io.ref("s1.ckpt"), "best")
    io.remove_checkpoint("s1.ckpt")
    io.remove_checkpoint("s2.ckpt")
    assert [s.step for s in store.log("lit")] == [1]  # kept by best; s2 deleted
    assert sorted(store.tags()) == ["best"]


def test_the_interval_callback_saves_when_a_take_is_due(tmp_path: Path) -> None:
    """CkstoreInterval asks its TakeInterval after every batch and saves through the plugin
    when it says so (pinned here to every 3 steps: the costs it measures do not matter)."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=1024, inline_bytes=64, create=True)
    io = CkstoreCheckpointIO(store, run="lit")
    every = ckstore.TakeInterval(start=3, min_steps=3, max_steps=3)
    trainer = pl.Trainer(
        max_epochs=2,  # 4 batches an epoch: 8 steps
        plugins=[io],
        callbacks=[CkstoreInterval(every, dirpath=tmp_path / "ckpts")],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Regressor(seed=0), _data())
    assert [s.step for s in store.log("lit")] == [6, 3]
    assert sorted(store.tags()) == ["lit/interval-3.ckpt", "lit/interval-6.ckpt"]
    assert io.load_checkpoint(tmp_path / "ckpts" / "interval-6.ckpt")["global_step"] == 6
    assert every.state()["takes"] == 2 and not list(tmp_path.rglob("*.ckpt"))
