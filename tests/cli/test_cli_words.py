"""What the command line prints for people (issue 35, item 9): a number and its noun agree,
``check`` names its problems in sentences and says what its chunk counts count, the progress
bars say import and export, and a clone's snapshots are at its origin, not "pushed"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import cli, objects
from ckstore.cli import _format as fmt
from ckstore.cli._log import where
from tests.support.cli import run

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with ckstore.open(path, create=True, **TINY) as store:
        store.take({"m": ckstore.StateDict(w=torch.arange(512.0))}, run="one", step=1)
    return path


def test_a_number_and_its_noun_agree() -> None:
    assert fmt.count(1, "chunk") == "1 chunk" and fmt.count(2, "chunk") == "2 chunks"
    assert fmt.count(1, "entry", "entries") == "1 entry"
    assert fmt.count(0, "entry", "entries") == "0 entries"


def test_rm_ls_and_show_say_one_thing_once(store_path: Path, capsys: Any) -> None:
    s = ("--store", str(store_path))
    code, out, _ = run(capsys, *s, "ls", "one")
    assert code == 0 and "1 entry," in out
    code, out, _ = run(capsys, *s, "show", "one")
    assert code == 0 and "1 tensor, 0 values" in out
    code, out, _ = run(capsys, *s, "rm", "--run", "one", "--yes")
    assert code == 0 and "deleted run one: 1 snapshot" in out and "1 snapshots" not in out


def test_check_names_its_problems_in_sentences(store_path: Path, capsys: Any) -> None:
    s = ("--store", str(store_path))
    code, out, _ = run(capsys, *s, "check", "--read-data")
    assert code == 0 and "ok: True" in out
    assert "note: chunks counts every chunk the index records" in out and "`du`" in out
    with ckstore.open(store_path) as store:
        cid = store.get("one").manifest.entries["m/w"].chunks[0].id  # type: ignore[union-attr]
        loc = store.repository.index.chunk_locations([cid])[cid]
    pack = store_path / objects.pack_name(loc.pack_id)
    data = bytearray(pack.read_bytes())
    data[loc.offset + 3] ^= 1
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    code, out, _ = run(capsys, *s, "check", "--read-data")
    assert code == 1 and "problems: " in out
    lines = [line for line in out.splitlines() if line.startswith("  - ")]
    assert lines and all("{" not in line for line in lines)  # sentences, not JSON
    assert any("one@1" in line and "m/w" in line for line in lines)


def test_the_import_and_export_bars_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    class Bar:
        def __init__(self, total: int, desc: str, **_: Any) -> None:
            made.append(desc)
            self.total, self.n = total, 0

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            pass

    import sys
    import types

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for label, engine in (("import", "take"), ("export", "restore")):
        bar = fmt.bar(label)
        assert bar is not None
        bar(engine, 1, 2)
    assert made == ["import", "export"]


def test_a_clones_snapshots_are_at_its_origin(
    store_path: Path, tmp_path: Path, capsys: Any
) -> None:
    assert cli.main(["clone", str(store_path), str(tmp_path / "copy")]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "--store", str(tmp_path / "copy"), "log")
    assert code == 0 and "at origin" in out and "pushed" not in out
    assert where({"state": "pushing", "remotes": []}) == "pushing"
    assert where({"state": "local", "remotes": []}) == "local"
