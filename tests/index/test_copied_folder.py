"""A copy of a store folder opened on the store's own (PostgreSQL) index is refused, so it can
never move packs the original's snapshots need; a store moved away from a folder that is gone
is followed. Before, the index knew only the store id, which the copy shares: a gc in the copy
rewrote a pack into the copy alone and pointed the shared rows there, and the original's
committed snapshot no longer restored."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import ConflictError
from tests.conftest import TINY
from tests.support.pgserver import PgServer

pytestmark = pytest.mark.postgres


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2048, generator=g), "b": torch.randn(256, generator=g)}


def test_a_copied_folder_on_the_same_index_is_refused(tmp_path: Path, pg: PgServer) -> None:
    index = pg.new_database()
    with ckstore.open(tmp_path / "store", index=index, create=True, **TINY) as original:
        first = _state(1)
        gone = original.take({"s": ckstore.StateDict(first)}, run="r", step=1)
        second = {"w": first["w"].clone(), "b": first["b"]}
        second["w"][:1024] += 1.0  # half of gone's pack stays in use by keep
        keep = original.take({"s": ckstore.StateDict(second)}, run="r", step=2)
        shutil.copytree(tmp_path / "store", tmp_path / "copy")  # a backup, a move to a new disk
        with pytest.raises(ConflictError, match="is a copy of the store at"):
            copy = ckstore.open(tmp_path / "copy", index=index, **TINY)
            copy.delete(gone.id)
            copy.gc(grace_seconds=0, repack_below=0.99)  # before: in the copy only
            copy.close()
        out = {"w": torch.zeros(2048), "b": torch.zeros(256)}
        original.get(keep.id).restore({"s": ckstore.StateDict(out)})
        assert torch.equal(out["w"], second["w"]) and torch.equal(out["b"], second["b"])
        assert original.check(read_data=True).problems == []
    # the original still opens, by its own path and through a link to it
    (tmp_path / "link").symlink_to(tmp_path / "store")
    for path in (tmp_path / "store", tmp_path / "link"):
        with ckstore.open(path, index=index, **TINY) as again:
            assert again.get("r").id == keep.id


def test_a_store_moved_away_from_its_folder_is_followed(tmp_path: Path, pg: PgServer) -> None:
    index = pg.new_database()
    with ckstore.open(tmp_path / "store", index=index, create=True, **TINY) as store:
        snap = store.take({"s": ckstore.StateDict(_state(1))}, run="r", step=1)
    shutil.move(tmp_path / "store", tmp_path / "moved")  # to a new disk: the old folder is gone
    with ckstore.open(tmp_path / "moved", index=index, **TINY) as moved:
        assert moved.get("r").id == snap.id
    shutil.copytree(tmp_path / "moved", tmp_path / "backup")
    with pytest.raises(ConflictError, match="moved"):  # the index follows the move
        ckstore.open(tmp_path / "backup", index=index, **TINY)
