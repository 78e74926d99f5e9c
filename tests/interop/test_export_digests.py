"""Exports carry proof: every single-byte change of an exported file is found by
``verify_path`` (``ckstore verify``), and an import refuses a file that does not match its
digests, naming the tensor."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.errors import CorruptionError
from ckstore.format.digests import METADATA_KEY, SIDECAR
from ckstore.format.verify import verify_path
from ckstore.interop import verify_checkpoint
from ckstore.interop._digests import torch_file_digests

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _snapshot(tmp_path: Path) -> ckstore.StoredSnapshot:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    gen = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(40, 8, generator=gen),
        "b": torch.randn(24, generator=gen).bfloat16(),
        "c": torch.arange(16, dtype=torch.int32),
    }
    return store.take({"model": ckstore.StateDict(state)}, run="r", step=3)


def _flip_all(path: Path, check: Path, positions: range | list[int]) -> list[int]:
    """Positions whose change (xor 0x01, then xor 0xFF) verify did not notice."""
    raw = path.read_bytes()
    missed = []
    for pos in positions:
        for mask in (0x01, 0xFF):
            data = bytearray(raw)
            data[pos] ^= mask
            path.write_bytes(data)
            if verify_path(str(check), torch_tensors=torch_file_digests).ok:
                missed.append(pos)
    path.write_bytes(raw)
    return missed


def test_safetensors_export_every_byte_flip_is_found(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    out = tmp_path / "st"
    snap.export(out, format="safetensors")
    f = out / "model.safetensors"
    assert verify_path(str(f)).ok and verify_path(str(out)).ok
    header = json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")])
    assert set(json.loads(header["__metadata__"][METADATA_KEY])["tensors"]) == {"a", "b", "c"}
    size = f.stat().st_size
    lone = tmp_path / "lone" / "model.safetensors"  # the file alone: its own digests only
    lone.parent.mkdir()
    shutil.copyfile(f, lone)
    assert _flip_all(lone, lone, range(size)) == []  # every header and data byte, alone
    assert (
        _flip_all(f, out, range(0, size, 3)) == []
    )  # in its folder (sidecar too), every third byte


def test_sidecar_every_byte_flip_is_found(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    out = tmp_path / "t"
    snap.export(out, format="torch")
    side = out / SIDECAR
    assert _flip_all(side, out, range(side.stat().st_size)) == []
    st = tmp_path / "st"
    snap.export(st, format="safetensors")
    (st / SIDECAR).unlink()  # a folder export without its digests file: not passed
    report = verify_path(str(st))
    assert (
        not report.ok
        and report.problems[0].file == SIDECAR
        and "missing" in report.problems[0].problem
    )
    assert verify_path(str(st / "model.safetensors")).ok  # the file alone still checks


def test_torch_and_dcp_exports_every_sampled_byte_flip_is_found(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    for fmt, name in (("torch", "checkpoint.pt"), ("dcp", "__0_0.distcp")):
        out = tmp_path / fmt
        snap.export(out, format=fmt)
        assert verify_path(str(out)).ok
        f = out / name
        size = f.stat().st_size
        sample = sorted(set(range(0, 256)) | set(range(size - 256, size)) | set(range(0, size, 17)))
        assert _flip_all(f, out, sample) == [], fmt
    meta = tmp_path / "dcp" / ".metadata"
    assert _flip_all(meta, tmp_path / "dcp", range(0, meta.stat().st_size, 5)) == []


def test_a_damaged_tensor_is_named(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    out = tmp_path / "st"
    snap.export(out, format="safetensors")
    f = out / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x40  # last byte: tensor c's data (written in key order a, b, c)
    f.write_bytes(raw)
    report = verify_path(str(out))
    assert {(p.file, p.tensor) for p in report.problems} == {
        ("model.safetensors", "c"),
        ("model.safetensors", None),
    }
    torch_out = tmp_path / "pt"
    snap.export(torch_out, format="torch")
    pt = torch_out / "checkpoint.pt"
    loaded = torch.load(pt, weights_only=True)
    data = bytearray(pt.read_bytes())
    needle = loaded["model"]["a"].numpy().tobytes()[:16]
    at = bytes(data).find(needle)
    data[at] ^= 0x01
    pt.write_bytes(data)
    named = verify_path(str(torch_out), torch_tensors=torch_file_digests)
    assert [(p.file, p.tensor) for p in named.problems] == [("checkpoint.pt", "model/a")]
    assert not verify_path(str(torch_out)).ok  # without torch: the file is named


def test_import_checks_digests_and_names_the_tensor(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    out = tmp_path / "st"
    snap.export(out, format="safetensors")
    store = ckstore.open(tmp_path / "s2", create=True, **TINY)
    good = store.import_checkpoint(out, run="ok")
    assert torch.equal(good.read_object("model/a"), snap.read_object("model/a"))
    assert SIDECAR not in json.dumps(
        good.get_manifest() and list(good.get_manifest())
    )  # not kept as a file
    f = out / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x40
    f.write_bytes(raw)
    with pytest.raises(CorruptionError, match="model.safetensors: tensor 'c': bytes differ"):
        store.import_checkpoint(out, run="bad")
    with pytest.raises(CorruptionError, match="tensor 'c'"):
        store.import_checkpoint(f, run="bad")  # the file alone carries its digests too
    assert store.log("bad") == []
    store.import_checkpoint(out, run="forced", verify=False)  # the caller's choice
    store.close()


def test_a_checkpoint_without_digests_is_not_passed_as_verified(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, plain)
    report = verify_checkpoint(plain)
    assert not report.ok and report.files == 0 and "no ckstore digests" in str(report.problems[0])
    store = ckstore.open(tmp_path / "s", create=True)
    store.import_checkpoint(plain, run="r")  # nothing to check: imported as before
    store.close()
    os.remove(plain)
