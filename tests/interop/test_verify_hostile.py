"""``ckstore verify`` and an import's check against hostile export folders.

Before: a sealed safetensors file from another export beside a sharded one passed (exit 0,
and Hugging Face loads ``model.safetensors`` first); names with ``..`` or absolute paths in
the digests file were read and counted; a FIFO in the folder hung verify and the import's
check forever; a deeply nested digests file or header, and ``data_offsets`` of ``1e999``,
ended in RecursionError / OverflowError.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.errors import CkstoreError, CorruptionError
from ckstore.format.digests import METADATA_KEY, SIDECAR, digest, sidecar_bytes
from ckstore.format.verify import verify_path
from ckstore.interop import verify_checkpoint
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _snapshot(tmp_path: Path, seed: int = 0) -> ckstore.StoredSnapshot:
    store = ckstore.open(tmp_path / f"s{seed}", create=True, **TINY)
    gen = torch.Generator().manual_seed(seed)
    state = {f"l{i}.weight": torch.randn(64, 8, generator=gen) for i in range(4)}
    return store.take({"model": ckstore.StateDict(state)}, run="r", step=seed)


def _sharded(tmp_path: Path) -> Path:
    out = tmp_path / "sharded"
    _snapshot(tmp_path).export(out, format="hf", shard_bytes=3000)
    assert (out / "model.safetensors.index.json").exists() and verify_path(str(out)).ok
    return out


def _problems(report) -> dict[str, str]:
    return {p.file: p.problem for p in report.problems}


def _verify_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ckstore", "verify", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def _reseal(folder: Path, files: dict[str, tuple[int, str]]) -> None:
    """Rewrite the folder's digests file to list ``files`` (a valid, sealed digests file)."""
    doc = json.loads((folder / SIDECAR).read_bytes())
    about = {k: doc[k] for k in ("snapshot", "run", "step")}
    (folder / SIDECAR).write_bytes(sidecar_bytes(files, doc["tensors"], about))


def _listed(folder: Path) -> dict[str, tuple[int, str]]:
    doc = json.loads((folder / SIDECAR).read_bytes())
    return {n: (r["size"], r["blake3"]) for n, r in doc["files"].items()}


# --- files the digests file does not list ------------------------------------------------------
def test_a_sealed_file_from_another_export_beside_a_sharded_one_is_a_finding(tmp_path):
    out = _sharded(tmp_path)
    other = tmp_path / "other"
    _snapshot(tmp_path, seed=1).export(other, format="hf")
    shutil.copyfile(other / "model.safetensors", out / "model.safetensors")
    assert verify_path(str(other / "model.safetensors")).ok  # sealed, valid on its own
    report = verify_path(str(out))
    assert not report.ok
    assert "not listed in ckstore-digests.json" in _problems(report)["model.safetensors"]
    assert not verify_path(str(out / "model.safetensors")).ok  # asked about the file alone too
    cli = _verify_cli(str(out))
    assert cli.returncode == 5, cli.stdout + cli.stderr
    assert "model.safetensors" in cli.stdout
    store = ckstore.open(tmp_path / "dst", create=True, **TINY)
    with pytest.raises(CorruptionError, match="model.safetensors.*not listed"):
        store.import_checkpoint(out, run="x")
    assert store.log() == []
    store.close()


def test_any_unlisted_file_is_a_finding(tmp_path):
    out = _sharded(tmp_path)
    (out / "notes.txt").write_text("added later")
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_bytes(b"\0" * 8)
    found = _problems(verify_path(str(out)))
    assert set(found) == {"notes.txt", "sub/x.bin"}


# --- names in the digests file ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.bin", "/ABS/outside.bin", "a/../../outside.bin"])
def test_a_digests_file_naming_a_path_outside_the_folder_is_a_finding_never_read(tmp_path, name):
    out = _sharded(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret bytes")
    name = name.replace("/ABS", str(tmp_path))
    # recorded with the outside file's true size and digest: reading it would "pass"
    _reseal(out, {**_listed(out), name: (outside.stat().st_size, digest(b"secret bytes"))})
    report = verify_path(str(out))
    assert not report.ok
    assert "not a path inside the folder" in _problems(report)[name]
    assert name not in report.checked
    with pytest.raises(CorruptionError, match="not a path inside the folder"):
        verify_checkpoint(out, refuse=True)


def test_a_listed_name_reached_through_a_link_is_a_finding(tmp_path):
    out = _sharded(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret bytes")
    (out / "link.bin").symlink_to(outside)
    (out / "dir").symlink_to(tmp_path)
    size, d = outside.stat().st_size, digest(b"secret bytes")
    _reseal(out, {**_listed(out), "link.bin": (size, d), "dir/outside.bin": (size, d)})
    found = _problems(verify_path(str(out)))
    assert "not a regular file" in found["link.bin"]
    assert "not a path inside the folder" in found["dir/outside.bin"]


# --- only regular files are opened --------------------------------------------------------------
_HANG_CHECK = textwrap.dedent(
    """
    import sys
    from ckstore.errors import CorruptionError
    from ckstore.interop import verify_checkpoint
    try:
        verify_checkpoint(sys.argv[1], refuse=True)
    except CorruptionError as exc:
        print("refused:", exc)
    """
)


@pytest.mark.parametrize("where", ["unlisted", "listed", "alone"])
def test_a_fifo_never_hangs_verify_or_an_import_check(tmp_path, where):
    out = _sharded(tmp_path)
    if where == "listed":  # a listed shard replaced by a FIFO
        victim = sorted(out.glob("model-0*.safetensors"))[0]
        victim.unlink()
        os.mkfifo(victim)
        target = out
    elif where == "unlisted":
        os.mkfifo(out / "pipe.safetensors")
        target = out
    else:
        os.mkfifo(tmp_path / "pipe.safetensors")
        target = tmp_path / "pipe.safetensors"
    cli = _verify_cli(str(target), timeout=60)  # before: blocked in open() forever
    said = "not listed" if where == "unlisted" else "not a regular file"
    assert cli.returncode == 5 and said in cli.stdout, cli.stdout + cli.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    check = subprocess.run(
        [sys.executable, "-c", _HANG_CHECK, str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert check.returncode == 0, check.stderr
    if where != "alone":
        assert "refused:" in check.stdout and said in check.stdout


# --- hostile structure: nesting and huge numbers ------------------------------------------------
def _header_file(path: Path, header: bytes, data: bytes = b"") -> None:
    pad = b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header) + len(pad)) + header + pad + data)


def test_a_deeply_nested_digests_file_is_a_finding(tmp_path):
    out = _sharded(tmp_path)
    (out / SIDECAR).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    report = verify_path(str(out))
    assert not report.ok and "nested" in _problems(report)[SIDECAR]
    cli = _verify_cli(str(out))
    assert cli.returncode == 5, cli.stdout + cli.stderr
    assert "internal error" not in cli.stderr
    with pytest.raises(CorruptionError, match=SIDECAR):
        verify_checkpoint(out, refuse=True)  # an import is refused, not crashed
    pt = tmp_path / "pt"  # a torch export: its digests file is all that covers it
    _snapshot(tmp_path, seed=2).export(pt, format="torch")
    (pt / SIDECAR).write_bytes(b"{" * 10 + b"[" * 200_000)
    store = ckstore.open(tmp_path / "dst", create=True, **TINY)
    with pytest.raises(CorruptionError, match=f"{SIDECAR}: not readable JSON"):
        store.import_checkpoint(pt, run="x")  # before: imported unchecked
    assert store.log() == []
    store.close()


@pytest.mark.parametrize(
    "field",
    [
        {"files": {"model.safetensors.index.json": ["size", 3]}},
        {"files": {"model.safetensors.index.json": {"size": "3", "blake3": "x"}}},
        {"tensors": {"model.safetensors.index.json": ["not", "a", "dict"]}},
        {"tensors": {"model.safetensors.index.json": {"w": 7}}},
    ],
)
def test_a_digests_file_of_the_wrong_shape_is_a_finding(tmp_path, field):
    out = _sharded(tmp_path)
    doc = {**json.loads((out / SIDECAR).read_bytes()), **field, "digest": "0" * 64}
    raw = json.dumps(doc, sort_keys=True).encode()
    (out / SIDECAR).write_bytes(raw.replace(b"0" * 64, digest(raw).encode(), 1))
    report = verify_path(str(out))  # before: AttributeError / TypeError on the entry
    assert not report.ok and "not a ckstore digests file" in _problems(report)[SIDECAR]


def test_a_deeply_nested_safetensors_header_is_a_finding_and_refused_on_import(tmp_path):
    f = tmp_path / "deep.safetensors"
    _header_file(f, b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    report = verify_path(str(f))
    assert not report.ok and "nested" in _problems(report)["deep.safetensors"]
    cli = _verify_cli(str(f))
    assert cli.returncode == 5, cli.stdout + cli.stderr
    store = ckstore.open(tmp_path / "dst", create=True, **TINY)
    with pytest.raises(CkstoreError, match="nested"):
        store.import_checkpoint(f, run="x")
    with pytest.raises(CkstoreError, match="nested"):
        store.import_checkpoint(f, run="x", verify=False)  # the format's reader too
    store.close()


@pytest.mark.parametrize("offsets", ["[0, 1e999]", "[1e999, 1e999]", "[-1e999, 4]", "[0, 4.5]"])
def test_data_offsets_that_are_not_integers_are_findings(tmp_path, offsets):
    tensors = {"a": digest(b"\0" * 4)}
    meta = json.dumps({"algorithm": "blake3", "header": "0" * 64, "tensors": tensors})
    entry = '"a":{"dtype":"F32","shape":[1],"data_offsets":' + offsets + "}"
    header = (
        '{"__metadata__":{"' + METADATA_KEY + '":' + json.dumps(meta) + "}," + entry + "}"
    ).encode()
    f = tmp_path / "big.safetensors"
    _header_file(f, header, b"\0" * 4)
    raw = f.read_bytes()  # sealed as a writer seals it: the header digest over the zeroed header
    n = 8 + struct.unpack("<Q", raw[:8])[0]
    f.write_bytes(raw.replace(b"0" * 64, digest(raw[:n]).encode()))
    assert "header bytes differ" not in str(verify_path(str(f)).problems)
    report = verify_path(str(f))
    assert not report.ok and any(p.tensor == "a" for p in report.problems), report.problems
    cli = _verify_cli(str(f))
    assert cli.returncode == 5, cli.stdout + cli.stderr
    with pytest.raises(CorruptionError):
        verify_checkpoint(f, refuse=True)
