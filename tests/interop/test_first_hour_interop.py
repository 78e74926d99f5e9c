"""Exports and imports the way a new user tries them (issue 35, items 14 and 15): a torch
export's folder imports back as the torch file it holds, a default safetensors export holds
the model's weights (not the optimizer's state), and ``verify --strict`` fails on a file no
digest covers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckstore
from ckstore.format.verify import verify_path
from ckstore.interop import detect_format
from tests.support.cli import run


def _trained() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with ckstore.open(tmp_path / "s", create=True) as s:
        s.take(_trained(), run="sft", step=1)
        yield s


def test_a_torch_exports_folder_imports_as_its_torch_file(store: Any, tmp_path: Path) -> None:
    out = tmp_path / "out-torch"
    store.get("sft").export(out, "torch")
    assert detect_format(str(out)) == "torch"  # not a Hugging Face folder
    back = store.import_checkpoint(out, run="back")
    assert sorted(back.manifest.apps) == ["_source", "model", "optim"]  # not nested in one app
    original = store.get("sft")
    for key in ("model/0.weight", "optim/state/0/exp_avg"):
        assert torch.equal(back.read_object(key), original.read_object(key))


def test_a_default_safetensors_export_holds_the_model(
    store: Any, tmp_path: Path, capsys: Any
) -> None:
    report = store.get("sft").export(tmp_path / "hf")
    assert report.skipped_apps == ["optim"]
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert names == {"0.weight", "0.bias", "1.weight", "1.bias"}  # from_pretrained's names
    every = store.get("sft").export(tmp_path / "all", keys="**")
    assert every.skipped_apps == [] and any(
        n.startswith("optim.") for n in load_file(tmp_path / "all" / "model.safetensors")
    )
    code, out, _ = run(capsys, "--store", store.url, "export", "sft", str(tmp_path / "cli"))
    assert code == 0 and "left out optim" in out and "--keys '**'" in out


def test_verify_strict_fails_on_a_file_no_digest_covers(
    store: Any, tmp_path: Path, capsys: Any
) -> None:
    folder = tmp_path / "sealed"
    folder.mkdir()
    store.get("sft").export(tmp_path / "hf")
    (folder / "model.safetensors").write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes())
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")  # dropped in
    loose = verify_path(str(folder))
    assert loose.unverified == ["pytorch_model.bin"]
    strict = verify_path(str(folder), strict=True)
    assert not strict.ok and any(p.file == "pytorch_model.bin" for p in strict.problems)
    code, out, _ = run(capsys, "verify", str(folder), "--strict")
    assert code == 5 and "UNVERIFIED  pytorch_model.bin" in out
    code, out, _ = run(capsys, "verify", str(tmp_path / "hf"), "--strict")
    assert code == 0  # an export as written passes strict too
