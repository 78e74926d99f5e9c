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


# --- keep_local="pointers": the checkpoint's bytes on disk once --------------------------------
class _Sharded(_Recording):
    """Saves its weights in shards of 4 kB (``model-0000i-of-0000n.safetensors`` + index)."""

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        assert output_dir is not None
        self.model.save_pretrained(output_dir, max_shard_size="4KB")


class _Listing(transformers.TrainerCallback):  # type: ignore[misc]
    """Records the names in each checkpoint folder as the Trainer wrote it (runs before the
    ckstore callback, which comes after it in ``callbacks``)."""

    def __init__(self) -> None:
        self.saved: dict[int, list[str]] = {}

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.saved[state.global_step] = sorted(p.name for p in folder.iterdir())


def _weights_of(snap: Any) -> dict[str, torch.Tensor]:
    return dict(snap.read_object("model"))


def _assert_pointers_only(folder: Path, snap: Any) -> None:
    """Every file the Trainer loads is a pointer to ``snap``; only small files are real."""
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" not in names and not [n for n in names if n.startswith("model-")]
    assert "model.safetensors.index.json" not in names
    assert not [n for n in names if n.startswith(".")]  # no temporary file left
    for name in ("pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        found = pointer.read_file(str(folder / name))
        assert found is not None and found.snapshot == snap.id, name
        assert found.app == ("model" if name == "pytorch_model.bin" else name.split(".")[0])
    kept = {k.split("/", 2)[2] for k in snap.get_manifest() if k.startswith("_source/files/")}
    for name in names:  # what is neither a pointer nor a kept file: the pickled arguments
        assert name in kept or pointer.read_file(str(folder / name)) or name == "training_args.bin"


def test_keep_local_pointers_leaves_no_weights_and_the_trainer_resumes_exactly(
    tmp_path: Path,
) -> None:
    """keep_local="pointers": the weights become a ``pytorch_model.bin`` pointer too; after a
    relaunch (the store reopened) the Trainer finds its last folder and resumes bit-exactly,
    and ``from_pretrained(folder)`` loads the weights from the store."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    first = _trainer(_model(0), out, [CkstoreCallback(store, run="sft", keep_local="pointers")])
    first.train()
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-8")
    for step in (4, 8):
        _assert_pointers_only(out / f"checkpoint-{step}", store.get(f"sft@{step}"))
        assert store.get(f"sft@{step}").metadata["hf"]["local"] == "all-pointers"
    weights = _weights_of(store.get("sft@8"))
    for name, value in first.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(out / "checkpoint-4")
    expected = _weights_of(store.get("sft@4"))
    assert expected.keys() <= loaded.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    store.close()

    shutil.rmtree(out / "checkpoint-8")  # the relaunch resumes from checkpoint-4
    store = ckstore.open(tmp_path / "store")
    second = _trainer(_model(1), out, [CkstoreCallback(store, run="sft", keep_local="pointers")])
    second.train(resume_from_checkpoint=True)
    assert second.losses == first.losses[4:]
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    _assert_pointers_only(out / "checkpoint-8", store.get("sft@8"))
    store.close()


def test_keep_local_pointers_loads_the_best_model_and_follows_the_rotation(
    tmp_path: Path,
) -> None:
    """``load_best_model_at_end`` reads the best weights through the pointer (the worst loss
    is "best" here, so that they are not the last weights); ``save_total_limit`` deletes
    snapshots as in the default mode."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    trainer = _trainer(
        _model(0), out, [CkstoreCallback(store, run="sft", keep_local="pointers")],
        save_steps=2, save_total_limit=2, eval_strategy="steps", eval_steps=2,
        metric_for_best_model="loss", greater_is_better=True, load_best_model_at_end=True,
    )  # fmt: skip
    trainer.train()
    best = trainer.state.best_global_step
    assert best != 8  # so the weights loaded at the end are not those trained last
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == sorted([f"checkpoint-{best}", "checkpoint-8"])  # 2 of 4 saves rotated out
    assert sorted(s.step for s in store.log("sft")) == sorted(int(k.split("-")[1]) for k in kept)
    assert store.get("sft/best").step == best
    _assert_pointers_only(out / f"checkpoint-{best}", store.get("sft/best"))
    weights = _weights_of(store.get("sft/best"))
    assert not torch.equal(
        weights["classifier.weight"], _weights_of(store.get("sft@8"))["classifier.weight"]
    )
    for name, value in weights.items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    assert store.gc(dry_run=True).grace_kept_bytes == 0
    store.close()


def test_keep_local_pointers_replaces_sharded_weights_by_one_pointer(tmp_path: Path) -> None:
    """Shards and their index give way to one ``pytorch_model.bin`` (the Trainer opens it
    before any index); the Trainer resumes from the folder exactly."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    listing = _Listing()
    first = _trainer(
        _model(0), out, [listing, CkstoreCallback(store, run="sft", keep_local="pointers")]
    )
    first.__class__ = _Sharded
    first.train()
    written = listing.saved[4]
    assert "model.safetensors.index.json" in written
    assert len([n for n in written if n.startswith("model-0")]) > 1
    snap = store.get("sft@4")
    assert snap.metadata["imported_from"]["format"] == "hf"
    files = [k for k in snap.get_manifest() if k.startswith("model/")]
    assert len(files) == len(first.model.state_dict())  # every shard was imported
    _assert_pointers_only(out / "checkpoint-4", snap)
    second = _trainer(_model(1), tmp_path / "out2", [])
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert second.losses == first.losses[4:]
    store.close()


def test_a_weights_pointer_is_written_only_over_weights_the_snapshot_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights are never lost: a crash before the pointer is written leaves the real
    ``model.safetensors`` (and no temporary file); a folder whose weights are not all in the
    snapshot keeps them."""
    from ckstore.integrations import _hf_pointers

    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    written = _hf_pointers.write_atomic

    def crash(path: str, data: bytes) -> None:
        if path.endswith("pytorch_model.bin"):
            raise KeyboardInterrupt  # killed between the import and the pointer
        written(path, data)

    monkeypatch.setattr(_hf_pointers, "write_atomic", crash)
    trainer = _trainer(
        _model(0), out, [CkstoreCallback(store, run="sft", keep_local="pointers")], max_steps=4
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    folder = out / "checkpoint-4"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith((".", "model", "pyt"))) == [
        "model.safetensors"
    ]
    assert store.get("sft@4").step == 4  # the import had committed
    monkeypatch.undo()

    snap = store.get("sft@4")
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    transformers.BertForSequenceClassification(_model(0).config).save_pretrained(
        other, max_shard_size="4KB"
    )  # the same names: a folder whose weights the snapshot holds with the same shapes
    assert _hf_pointers.point_weights(store, snap, str(other), str(other))
    assert pointer.read_file(str(other / "pytorch_model.bin")) is not None
    bigger = _model(0).config
    bigger.vocab_size = 60
    shutil.rmtree(other)
    shutil.copytree(folder, other)
    (other / "model.safetensors").unlink()
    transformers.BertForSequenceClassification(bigger).save_pretrained(other)
    assert not _hf_pointers.point_weights(store, snap, str(other), str(other))
    assert (other / "model.safetensors").is_file() and not (other / "pytorch_model.bin").exists()
    store.close()


def test_keep_local_takes_none_true_false_or_pointers(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", create=True)
    with pytest.raises(ckstore.errors.InvalidInputError, match="keep_local='weights'"):
        CkstoreCallback(store, keep_local="weights")  # type: ignore[arg-type]
    store.close()


def test_a_process_that_never_imported_ckstore_is_told_what_the_pointer_is(
    tmp_path: Path,
) -> None:
    """torch's weights-only loader refuses the pointer's one global and names it
    (``ckstore.integrations.pointer.load_pointer``); importing that module first (it
    allowlists that function alone) makes the same load read the weights from the store."""
    import subprocess
    import sys

    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    _trainer(
        _model(0), out, [CkstoreCallback(store, run="sft", keep_local="pointers")], max_steps=4
    ).train()
    expected = _weights_of(store.get("sft@4"))
    store.close()
    path = str(out / "checkpoint-4" / "pytorch_model.bin")
    refused = subprocess.run(
        [sys.executable, "-c", f"import torch; torch.load({path!r}, weights_only=True)"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "Unsupported global: GLOBAL ckstore.integrations.pointer.load_pointer" in refused.stderr
    script = (
        "import sys, torch, ckstore.integrations.pointer\n"
        f"sd = torch.load({path!r}, weights_only=True)\n"
        f"torch.save(sd, {str(tmp_path / 'read.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    read = torch.load(tmp_path / "read.pt", weights_only=True)
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[k], v) for k, v in expected.items())


# --- keep_local=False: the Trainer's rotation over snapshots whose folders are gone ------------
def _steps(store: Any, run: str = "hf") -> list[int]:
    return sorted(s.step for s in store.log(run))


def _nothing_left_to_reclaim(store: Any) -> None:
    """What the deleted snapshots used came back within the job: nothing waits for the grace
    period, and nothing unreferenced is left for a later gc."""
    assert store.gc(dry_run=True).grace_kept_bytes == 0
    assert store.gc(grace_seconds=0, dry_run=True).chunk_bytes_removed == 0


@pytest.mark.parametrize(
    "limit, evaluate",
    [(2, False), (2, True), (1, True), (3, False)],
    ids=["limit2", "limit2-best-older", "limit1-best-older", "limit3"],
)
def test_keep_local_false_rotates_the_store_as_the_trainer_rotates_its_folders(
    tmp_path: Path, limit: int, evaluate: bool
) -> None:
    """The snapshots left are those whose folders the Trainer itself leaves with the folders
    kept (``keep_local=True``, same run): the newest ``save_total_limit``, the best always
    kept (the worst loss is "best" here, so that it is an old one), and the best alone at the
    end with ``save_total_limit=1``. The kept ones restore the weights they were taken with."""
    best = dict(eval_strategy="steps", eval_steps=2, metric_for_best_model="loss")
    options = dict(save_steps=2, save_total_limit=limit, **(best if evaluate else {}))
    if evaluate:
        options["greater_is_better"] = True
    folders = ckstore.open(tmp_path / "kept", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out-kept"
    reference = _trainer(
        _model(0), out, [CkstoreCallback(folders, run="hf", keep_local=True)], **options
    )
    reference.train()
    expected = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert _steps(folders) == expected  # the rotation the store follows with folders
    folders.close()

    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    trainer = _trainer(
        _model(0), tmp_path / "out", [CkstoreCallback(store, run="hf", keep_local=False)],
        **options,
    )  # fmt: skip
    trainer.train()
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert _steps(store) == expected
    if evaluate:
        older = trainer.state.best_global_step
        assert older != 8 and older in expected and store.get("hf/best").step == older
    else:
        assert expected == [8 - 2 * i for i in range(limit)][::-1]
    _nothing_left_to_reclaim(store)
    newest = dict(store.get(f"hf@{expected[-1]}").read_object("model"))
    if expected[-1] == 8:  # the weights trained last
        assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in newest.items())
    for step in expected:
        folder = checkout(store, f"hf@{step}", tmp_path / f"restored-{step}")
        loaded = transformers.BertForSequenceClassification.from_pretrained(folder)
        weights = dict(store.get(f"hf@{step}").read_object("model"))
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    store.close()


def test_a_relaunch_continues_the_rotation_over_the_previous_process_snapshots(
    tmp_path: Path,
) -> None:
    """A new process (the store reopened, a new callback) that resumes from a checkout counts
    the snapshots the first one left, and rotates them out; the survivors resume exactly."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    callback = CkstoreCallback(store, run="hf", keep_local=False)
    first = _trainer(_model(0), out, [callback], save_steps=2, save_total_limit=2, max_steps=4)
    first.train()
    assert _steps(store) == [2, 4]
    store.close()

    store = ckstore.open(tmp_path / "store")
    folder = checkout(store, "hf@4", tmp_path / "resume")
    callback = CkstoreCallback(store, run="hf", keep_local=False)
    second = _trainer(_model(1), out, [callback], save_steps=2, save_total_limit=2)
    second.train(resume_from_checkpoint=folder)
    assert _steps(store) == [6, 8]
    _nothing_left_to_reclaim(store)
    third = _trainer(_model(2), tmp_path / "out3", [], save_steps=2, max_steps=8)
    third.train(resume_from_checkpoint=checkout(store, "hf@6", tmp_path / "resume6"))
    assert third.losses == second.losses[2:]  # the kept snapshot resumes exactly
    store.close()


class _TagAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Tags ``run@step`` as ``name`` once that save was imported (as a user would)."""

    def __init__(self, store: Any, ref: str, name: str) -> None:
        self.store, self.ref, self.name = store, ref, name

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.store.get(self.ref, None) is not None and self.name not in self.store.tags():
            self.store.tag(self.ref, self.name)


def test_keep_local_false_rotation_deletes_only_this_output_dirs_own_snapshots(
    tmp_path: Path,
) -> None:
    """Another run's snapshots from the same folders, the same run's from another
    output_dir, one imported from this output_dir with another keep_local, and one the user
    tagged all stay; the user's tag keeps its snapshot out of the count from then on."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    out = tmp_path / "out"
    other = CkstoreCallback(store, run="other", keep_local=False)
    _trainer(_model(0), out, [other], save_steps=2, max_steps=4).train()
    elsewhere = CkstoreCallback(store, run="hf", keep_local=False)
    _trainer(_model(0), tmp_path / "out2", [elsewhere], save_steps=3, max_steps=3).train()
    whole = CkstoreCallback(store, run="hf", keep_local=True)
    _trainer(_model(0), out, [whole], save_steps=1, max_steps=1).train()
    shutil.rmtree(out / "checkpoint-1")  # left in the store alone, with its path tag
    assert _steps(store) == [1, 3] and _steps(store, "other") == [2, 4]

    mine = CkstoreCallback(store, run="hf", keep_local=False)
    user = _TagAt(store, "hf@2", "keep")
    _trainer(_model(0), out, [mine, user], save_steps=2, save_total_limit=2).train()
    assert _steps(store) == [1, 2, 3, 6, 8]  # hf@4 rotated out; hf@2 kept by the user's tag
    assert store.tags()["keep"] == store.get("hf@2").id
    assert _steps(store, "other") == [2, 4]
    assert store.get("hf@1").metadata["hf"]["local"] == "full"
    assert store.get("hf@3").metadata["hf"]["folder"].endswith(f"out2{os.sep}checkpoint-3")
    _nothing_left_to_reclaim(store)
    store.close()


def test_keep_local_false_refuses_load_best_model_at_end(tmp_path: Path) -> None:
    """The best folder would be gone when the Trainer loads it at the end (it only warns, and
    keeps the last weights): refused before the first step, saying what to use instead."""
    store = ckstore.open(tmp_path / "store", chunk_bytes=4096, inline_bytes=64, create=True)
    trainer = _trainer(
        _model(0), tmp_path / "out", [CkstoreCallback(store, run="hf", keep_local=False)],
        save_steps=2, eval_strategy="steps", eval_steps=2, metric_for_best_model="loss",
        load_best_model_at_end=True,
    )  # fmt: skip
    with pytest.raises(ckstore.errors.InvalidInputError, match="keep_local='pointers'") as err:
        trainer.train()
    assert "load_best_model_at_end=True" in str(err.value) and "run='hf'" in str(err.value)
    assert trainer.losses == [] and store.log("hf") == []
    store.close()
