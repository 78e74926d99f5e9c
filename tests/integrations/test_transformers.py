"""The Hugging Face Trainer with the ckstore callback, against the real ``transformers``.

A tiny BERT classifier built in the test (no network, no hub download) trains 8 steps and
saves every 4 (or 2) into a store through :class:`CkstoreCallback`. The scenarios are those of
transformers' ``test_trainer_checkpointing.py``: the Trainer's own resume
(``resume_from_checkpoint=True``, ``get_last_checkpoint``) continues with exactly the losses of
the uninterrupted run, dropout included, from folders whose optimizer, scheduler and RNG files
are pointers into the store; ``save_total_limit`` and the best checkpoint are the store's
retention and its ``best`` tag; a snapshot checked out as a folder resumes exactly too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402 - in the test extra: a missing one fails, never skips

import ckstore
from ckstore.integrations import pointer
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


def _trainer(model: Any, out: Path, callbacks: list[Any], **kw: Any) -> _Recording:
    options = dict(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=4, logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-2,
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**options, **kw})
    t = _Recording(
        model=model, args=args, train_dataset=_Data(), eval_dataset=_Data(), callbacks=callbacks
    )
    t.losses = []
    return t


def test_trainer_saves_into_store_and_resumes_with_identical_loss(tmp_path: Path) -> None:
    """keep_local=False: only the store holds the checkpoints; checkout gives a folder back."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    callback = CkstoreCallback(store, run="hf", keep_local=False)
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


def test_the_default_wiring_keeps_folders_the_trainer_resumes_from(tmp_path: Path) -> None:
    """As docs/USAGE.md wires it: the folders stay (weights and small files as the Trainer
    wrote them, optimizer / scheduler / RNG files as pointers into the store), and the Trainer's
    own ``resume_from_checkpoint=True`` continues bit-exactly."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    first = _trainer(_model(0), out, [CkstoreCallback(store, run="sft")])
    first.train()
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-8")
    folder = out / "checkpoint-4"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        found = pointer.read_file(str(folder / name))
        assert found is not None and found.app == name.rsplit(".", 1)[0], name
        assert found.snapshot == store.get("sft@4").id
    assert pointer.read_file(str(folder / "model.safetensors")) is None  # read by name: real
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert torch.equal(
        optimizer["state"][0]["exp_avg"],
        store.get("sft@4").read_object("optimizer/state/0/exp_avg"),
    )
    # the Trainer resumes from the folder it finds itself (last: checkpoint-8), and from step 4
    shutil.rmtree(out / "checkpoint-8")
    second = _trainer(_model(1), out, [CkstoreCallback(store, run="sft")])
    second.train(resume_from_checkpoint=True)
    assert second.losses == first.losses[4:]
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    store.close()


def test_save_total_limit_and_the_best_checkpoint_are_the_stores_retention(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    trainer = _trainer(
        _model(0), out, [CkstoreCallback(store, run="sft")],
        save_steps=2, save_total_limit=1, eval_strategy="steps", eval_steps=2,
        metric_for_best_model="loss", load_best_model_at_end=True,
    )  # fmt: skip
    trainer.train()
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    best = trainer.state.best_global_step
    assert f"checkpoint-{best}" in kept and len(kept) <= 2
    assert sorted(s.step for s in store.log("sft")) == sorted(int(k.split("-")[1]) for k in kept)
    assert store.get("sft/best").step == best
    # the deleted checkpoints' bytes came back within the job
    assert store.gc(dry_run=True).grace_kept_bytes == 0
    store.close()


def test_keep_local_keeps_the_folder_whole(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    _trainer(_model(0), out, [CkstoreCallback(store, run="sft", keep_local=True)]).train()
    assert pointer.read_file(str(out / "checkpoint-4" / "optimizer.pt")) is None
    assert torch.load(out / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
    assert [s.step for s in store.log("sft")] == [8, 4]
    store.close()


def test_an_interval_makes_the_trainer_save_when_a_take_is_due(tmp_path: Path) -> None:
    """With ``interval``, the callback asks the Trainer to save whenever its TakeInterval says
    so (pinned here to every 3 steps), on top of the Trainer's own save_steps (4)."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    every = ckstore.TakeInterval(start=3, min_steps=3, max_steps=3)
    callback = CkstoreCallback(store, run="hf", interval=every)
    _trainer(_model(0), tmp_path / "out", [callback]).train()
    assert sorted(s.step for s in store.log("hf")) == [3, 4, 6, 8]
    assert every.state()["takes"] == 2
    store.close()
