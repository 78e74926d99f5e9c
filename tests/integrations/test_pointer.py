"""Pointer files: a checkpoint file that names its snapshot; loading it runs nothing but ckstore's
reader, and the trainers' non-plain values come back as what they were."""

from __future__ import annotations

import argparse
import enum
import io
import os
import pathlib
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import CheckpointNotFoundError, CorruptionError, SnapshotNotFoundError
from ckstore.integrations import pointer
from ckstore.integrations._paths import identity, path_tag
from ckstore.integrations._values import from_plain, to_plain


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


def _store(tmp_path: Path) -> ckstore.Store:
    return ckstore.open(tmp_path / "store", create=True, chunk_bytes=1024, inline_bytes=64)


def _snapshot(store: ckstore.Store) -> ckstore.StoredSnapshot:
    state = {
        "model": ckstore.StateDict(w=torch.arange(1000, dtype=torch.float32)),
        "optimizer": ckstore.StateDict(state={0: {"exp_avg": torch.ones(700)}}, lr=0.1),
    }
    return store.take(state, run="r", step=3)


def test_a_pointer_file_loads_with_torch_load_weights_only_and_holds_no_tensor_bytes(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    snap = _snapshot(store)
    path = tmp_path / "ck" / "model.ckpt"
    path.parent.mkdir()
    ptr = pointer.Pointer.to(store, snap.id, identity(path))
    path.write_bytes(pointer.to_bytes(ptr))
    assert path.stat().st_size < 4096  # 4 KB for 6.8 KB of tensors: only the pointer
    for weights_only in (True, False):
        got = torch.load(path, weights_only=weights_only)
        assert torch.equal(got["model"]["w"], torch.arange(1000, dtype=torch.float32))
        assert got["optimizer"]["lr"] == 0.1 and "_source" not in got
    only = pointer.Pointer.to(store, snap.id, identity(path), app="optimizer")
    assert torch.load(io.BytesIO(pointer.to_bytes(only)))["state"][0]["exp_avg"].sum() == 700
    assert pointer.read_file(str(path)) == ptr
    store.close()


def test_reading_a_pointer_runs_nothing_and_other_files_are_not_pointers(tmp_path: Path) -> None:
    """A file whose pickle calls anything but load_pointer is not read as a pointer (and not
    run); a real checkpoint, a missing file and a folder are not pointers either."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return os.system, (f"touch {marker}",)

    evil = tmp_path / "evil.ckpt"
    torch.save({"x": Evil()}, evil)
    real = tmp_path / "real.ckpt"
    torch.save({"w": torch.zeros(3)}, real)
    plain = tmp_path / "plain.ckpt"
    torch.save({"epoch": 1}, plain)
    for p in (evil, real, plain, tmp_path / "missing.ckpt", tmp_path):
        assert pointer.read_file(str(p)) is None
    assert not marker.exists()
    assert pointer.parse(b"PK not a zip") is None and pointer.parse(b"\x80\x02") is None


def test_a_malformed_pointer_is_refused(tmp_path: Path) -> None:
    for text in ("{}", "[1]", '{"format": "ckstore-pointer", "version": 1}', "not json"):
        with pytest.raises(CorruptionError):
            pointer.Pointer.from_json(text)
    bad = pointer.Pointer("s", "not-an-id", "/p").to_json()
    with pytest.raises(CorruptionError):
        pointer.Pointer.from_json(bad)
    buffer = io.BytesIO()
    torch.save(pointer._Call(bad), buffer)  # what a damaged pointer file holds
    with pytest.raises(CorruptionError):
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_a_pointer_to_a_deleted_snapshot_is_a_missing_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    snap = _snapshot(store)
    data = pointer.to_bytes(pointer.Pointer.to(store, snap.id, "/x/model.ckpt"))
    store.delete(snap.id)
    with pytest.raises(CheckpointNotFoundError, match="model.ckpt") as caught:
        torch.load(io.BytesIO(data), weights_only=True)
    assert isinstance(caught.value, FileNotFoundError)
    assert isinstance(caught.value, SnapshotNotFoundError)
    store.close()


def test_a_pointer_reopens_its_store_in_a_process_that_has_none_open(tmp_path: Path) -> None:
    store = _store(tmp_path)
    snap = _snapshot(store)
    data = pointer.to_bytes(pointer.Pointer.to(store, snap.id, "/x/model.ckpt"))
    store.close()  # nothing of this store is open now: the pointer opens it read-only
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert got["model"]["w"][999] == 999


def test_the_pointer_file_is_a_zip_with_one_global(tmp_path: Path) -> None:
    store = _store(tmp_path)
    snap = _snapshot(store)
    data = pointer.to_bytes(pointer.Pointer.to(store, snap.id, "/x/model.ckpt"))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (pkl,) = [n for n in archive.namelist() if n.endswith("data.pkl")]
        raw = archive.read(pkl)
    globals_ = [a for op, a, _ in pickletools.genops(raw) if op.name == "GLOBAL"]
    assert globals_ == ["ckstore.integrations.pointer load_pointer"]
    assert torch.equal(pickle.loads(raw)["model"]["w"], snap.read_object("model/w"))
    store.close()


def test_non_plain_values_travel_as_data_and_come_back() -> None:
    value = {
        "path": pathlib.Path("/data/set"),
        "pure": pathlib.PurePosixPath("a/b"),
        "ns": argparse.Namespace(lr=0.1, layers=[1, 2], where=pathlib.Path("x")),
        "color": Color.BLUE,
        "nested": [(Color.RED, {"p": pathlib.Path("y")})],
        "types": [dict, argparse.Namespace],
        "plain": {"a": 1, "t": torch.zeros(2)},
    }
    plain = to_plain(value)
    assert plain["plain"] is value["plain"]  # unchanged containers are not copied

    def walk(v: Any) -> None:
        assert not isinstance(v, (pathlib.PurePath, argparse.Namespace, enum.Enum, type)), v
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(plain)
    back = from_plain(plain)
    assert back["path"] == value["path"] and type(back["pure"]) is pathlib.PurePosixPath
    assert back["ns"] == value["ns"] and back["color"] is Color.BLUE
    assert back["nested"] == [(Color.RED, {"p": pathlib.Path("y")})]
    assert back["types"] == [dict, argparse.Namespace]


def test_an_enum_class_that_is_not_imported_comes_back_as_its_value() -> None:
    plain = {"__ckstore_value__": "enum", "class": "nowhere.Mode", "name": "FAST", "value": 3}
    assert from_plain(plain) == 3
    plain = {**plain, "class": f"{__name__}.Color", "name": "RED"}
    assert from_plain(plain) is Color.RED


def test_identity_is_the_full_normalised_path(tmp_path: Path) -> None:
    a, b = tmp_path / "exp_a" / "last.ckpt", tmp_path / "exp_b" / "last.ckpt"
    assert identity(a) != identity(b)
    assert path_tag("lit", identity(a)) != path_tag("lit", identity(b))
    assert identity(tmp_path / "exp_a" / ".." / "exp_a" / "last.ckpt") == identity(a)
    assert identity("memory://bucket/x/../y.ckpt") == "memory://bucket/y.ckpt"
    tag = path_tag("lit", identity(tmp_path / ("x" * 300 + ".ckpt")))
    assert len(tag) <= 128 and tag.startswith("lit/")
