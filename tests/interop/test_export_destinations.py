"""Where an export writes: into the directory a symbolic link names, and never outside its
directory whatever file names a snapshot's import record holds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import CorruptionError


def _store(tmp_path: Path) -> ckstore.Store:
    return ckstore.open(tmp_path / "s", create=True, chunk_bytes=1024, inline_bytes=64)


def test_export_into_a_symlink_to_a_directory_fills_that_directory(tmp_path: Path) -> None:
    store = _store(tmp_path)
    snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    report = snap.export(tmp_path / "link", format="torch")
    assert (tmp_path / "link").is_symlink() and sorted(os.listdir(real)) == [
        "checkpoint.pt",
        "ckstore-digests.json",
    ]
    assert report.path == str(tmp_path / "link")  # as given
    got = torch.load(real / "checkpoint.pt", weights_only=True)
    assert torch.equal(got["model"]["weight"], snap.read_object("model/weight"))
    store.close()


def _crafted(store: ckstore.Store, info: dict[str, object]) -> ckstore.StoredSnapshot:
    """A snapshot whose import record (app ``_source``) names files as ``info`` says."""
    full = {
        "format": "torch",
        "name": "checkpoint.pt",
        "flat_app": None,
        "safetensors_metadata": {},
        "torch_files": {},
        "dcp_chunks": {},
        "skipped": [],
        **info,
    }
    state = {
        "model": ckstore.StateDict(w=torch.arange(64.0)),
        "_source": ckstore.StateDict(info=json.dumps(full), files={}),
    }
    return store.take(state, run="crafted", step=1)


@pytest.mark.parametrize(
    ("fmt", "info"),
    [
        ("torch", {"name": "../escaped.pt"}),
        ("torch", {"name": "/tmp/escaped-abs.pt"}),
        ("hf", {"format": "hf", "name": "x", "torch_files": {"../escaped.pt": "model"}}),
    ],
)
def test_an_import_record_cannot_make_an_export_write_outside_its_directory(
    tmp_path: Path, fmt: str, info: dict[str, object]
) -> None:
    store = _store(tmp_path)
    snap = _crafted(store, info)
    with pytest.raises(CorruptionError, match="not a relative path inside the export"):
        snap.export(tmp_path / "out" / "dest", format=fmt)
    assert (
        not (tmp_path / "out" / "escaped.pt").exists() and not Path("/tmp/escaped-abs.pt").exists()
    )
    assert not (tmp_path / "out" / "dest").exists()  # nothing published
    store.close()


@pytest.mark.parametrize("where", ["the store", "its parent", "inside it", "via a link"])
def test_an_export_with_force_never_replaces_the_store_it_reads(tmp_path: Path, where: str) -> None:
    """Before, ``export(<the store's folder>, force=True)`` (``ckstore export REF <store>
    --force``) moved the store aside, deleted it and reported a successful export."""
    store = _store(tmp_path)
    snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
    root = tmp_path / "s"
    if where == "via a link":
        (tmp_path / "link").symlink_to(root)
    dest = {
        "the store": root,
        "its parent": tmp_path,
        "inside it": root / "objects",
        "via a link": tmp_path / "link",
    }[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ckstore.errors.DestinationExistsError, match="uses|inside the store"):
        snap.export(dest, format="torch", force=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    store.close()
    with ckstore.open(root) as again:
        assert again.check(read_data=True).ok and again.get("r@1").id == snap.id


def test_an_export_with_force_never_replaces_another_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
    other = tmp_path / "other"
    ckstore.open(other, create=True).close()
    with pytest.raises(ckstore.errors.DestinationExistsError, match="holds the ckstore store"):
        snap.export(other, format="torch", force=True)
    assert (other / "ckstore.json").exists()
    store.close()


def test_an_export_with_force_never_harms_a_store_it_holds_or_lies_in(tmp_path: Path) -> None:
    """Before, only a destination that was a store itself was refused: a folder holding
    another store (``runs/`` with ``runs/other``) was deleted with it, and one inside another
    store (``other/manifests``) replaced."""
    store = _store(tmp_path)
    snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
    other = tmp_path / "runs" / "other"
    with ckstore.open(other, create=True) as o:
        o.take({"model": torch.nn.Linear(4, 4)}, run="keep", step=1)
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "runs").rglob("*"))
    with pytest.raises(ckstore.errors.DestinationExistsError, match="holds the ckstore store"):
        snap.export(tmp_path / "runs", format="torch", force=True)
    for inner in ("manifests", "packs", "nothing-yet"):
        with pytest.raises(ckstore.errors.DestinationExistsError, match="inside the store"):
            snap.export(other / inner, format="torch", force=True)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "runs").rglob("*")) == before
    with ckstore.open(other) as o:
        assert o.check(read_data=True).ok
    store.close()


def test_an_export_with_force_never_replaces_the_folder_of_the_stores_own_index(
    tmp_path: Path,
) -> None:
    idx = tmp_path / "idx"
    idx.mkdir()
    db = idx / "index.sqlite"
    with ckstore.open(tmp_path / "s", create=True, index=f"sqlite:///{db}") as store:
        snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
        with pytest.raises(ckstore.errors.DestinationExistsError, match="uses"):
            snap.export(idx, format="torch", force=True)
        assert db.exists() and store.get("r@1").id == snap.id
        report = snap.export(tmp_path / "out", format="torch")  # elsewhere: fine
        assert report.files


def test_an_export_with_force_never_replaces_a_remotes_store_or_its_index(
    tmp_path: Path,
) -> None:
    """A remote's store folder is refused as any store is; its index file, kept outside that
    folder, was not: ``--force`` deleted the only index of the remote's snapshots."""
    idx = tmp_path / "remote-idx"
    idx.mkdir()
    db = idx / "index.sqlite"
    with ckstore.open(tmp_path / "s", create=True) as store:
        store.add_remote("backup", str(tmp_path / "r"), index=f"sqlite:///{db}")
        snap = store.take({"model": torch.nn.Linear(8, 8)}, run="r", step=1)
        store.push("backup")
        assert db.exists()
        with pytest.raises(ckstore.errors.DestinationExistsError, match="remote 'backup'"):
            snap.export(idx, format="torch", force=True)
        with pytest.raises(ckstore.errors.DestinationExistsError):
            snap.export(tmp_path / "r", format="torch", force=True)
        assert db.exists()
    with ckstore.open(tmp_path / "r", index=f"sqlite:///{db}") as remote:
        assert remote.get("r@1").id == snap.id
        assert remote.check(read_data=True).ok


def test_an_export_onto_a_full_disk_says_so_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while the files are written: before, a bare ``OSError`` (errno 28)
    came back, where takes and gc raise the typed ``NoSpaceError`` that says what to do."""
    import errno

    from ckstore.interop import _hf

    with ckstore.open(tmp_path / "store", create=True) as store:
        store.take({"m": ckstore.StateDict({"w": torch.randn(64, 64)})}, run="r", step=1)
        real = _hf.write_stream

        def full(f: Any, *args: Any, **kwargs: Any) -> None:
            f.write(b"x" * 100)  # a part of the file made it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(_hf, "write_stream", full)
        with pytest.raises(ckstore.NoSpaceError, match="nothing was published"):
            store.get("r@1").export(tmp_path / "out")
        monkeypatch.setattr(_hf, "write_stream", real)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no temporary directory left
