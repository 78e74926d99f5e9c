"""The Hugging Face Trainer with the ckstore callback, against the real ``transformers``.

A tiny BERT classifier built in the test (no network, no hub download) trains 8 steps and
saves every 4 into a store through :class:`CkstoreCallback`; a fresh Trainer with other
initial weights resumes from the snapshot at step 4 (checked out as a checkpoint folder)
and steps 5-8 have exactly the losses of the uninterrupted run, dropout included (the RNG
state comes back too).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402 - in the test extra: a missing one fails, never skips

import ckstore
from ckstore.integrations.transformers import CkstoreCallback, checkout

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 50, (16, 12), generator=gen)
        self.labels = torch.randint(0, 2, (16,), generator=gen)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": self.labels[i],
        }


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


class _Recording(transformers.Trainer):  # type: ignore[misc]
    losses: list[float]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
        self.losses.append(float((out[0] if return_outputs else out).detach()))
        return out


def _trainer(model: Any, out: Path, callbacks: list[Any]) -> _Recording:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=4, logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-2,
    )  # fmt: skip
    t = _Recording(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)
    t.losses = []
    return t


def test_trainer_saves_into_store_and_resumes_with_identical_loss(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    callback = CkstoreCallback(store, run="hf")
    first = _trainer(_model(0), tmp_path / "out", [callback])
    first.train()
    assert len(first.losses) == 8
    assert [s.step for s in store.log("hf")] == [8, 4]
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # imported, then removed
    keys = store.get("hf@4").get_manifest()
    apps = {k.split("/", 1)[0] for k in keys}
    assert {"model", "optimizer", "scheduler", "rng_state", "_source"} <= apps
    assert "_source/files/trainer_state.json" in keys and "_source/files/config.json" in keys
    # the second save reused what did not change (e.g. the frozen position ids and config)
    assert store.get("hf@8").stats["reused_chunks"] > 0

    folder = checkout(store, "hf@4", tmp_path / "resume")
    second = _trainer(_model(1), tmp_path / "out2", [])
    second.train(resume_from_checkpoint=folder)
    assert second.losses == first.losses[4:]  # bit-identical floats, dropout included
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_interval_makes_the_trainer_save_when_a_take_is_due(tmp_path: Path) -> None:
    """With ``interval``, the callback asks the Trainer to save whenever its TakeInterval says
    so (pinned here to every 3 steps), on top of the Trainer's own save_steps (4)."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    every = ckstore.TakeInterval(start=3, min_steps=3, max_steps=3)
    callback = CkstoreCallback(store, run="hf", interval=every)
    _trainer(_model(0), tmp_path / "out", [callback]).train()
    assert sorted(s.step for s in store.log("hf")) == [3, 4, 6, 8]
    assert every.state()["takes"] == 2
