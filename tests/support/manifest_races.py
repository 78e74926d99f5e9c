"""The stores of the manifest races (a snapshot sent again while a gc at the destination
deletes its manifest): tests/remote/test_manifest_again.py and test_manifest_gc_failures.py."""

from __future__ import annotations

import importlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.support.remotes import KNOBS, fill

transfer = importlib.import_module("ckstore.remote.transfer")


def pushed_yesterday(
    tmp_path: Path, steps: list[int], name: str = "origin"
) -> tuple[ckstore.Store, ckstore.Store]:
    """A source store with run ``r`` at ``steps``, pushed to remote ``name`` (at
    ``tmp_path/"remote"``) a day ago, so its manifest rows are past any grace period; the
    source and a handle on the remote."""
    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", steps)
    src.add_remote(name, tmp_path / "remote")
    src.push(name)
    with sqlite3.connect(tmp_path / "remote" / "index.sqlite") as db:
        db.execute("UPDATE manifests SET created_at = created_at - 86400")
    return src, ckstore.open(tmp_path / "remote")


def killed_push(src: ckstore.Store, monkeypatch: pytest.MonkeyPatch, name: str = "origin") -> None:
    """A push of ``src`` to ``name`` killed between its manifest put and its commit: the
    manifest object is left there, an orphan."""
    real: Any = transfer.commit_manifest

    def dies(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt("killed between the manifest put and the commit")

    monkeypatch.setattr(transfer, "commit_manifest", dies)
    with pytest.raises(KeyboardInterrupt):
        src.push(name)
    monkeypatch.setattr(transfer, "commit_manifest", real)
