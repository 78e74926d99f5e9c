"""Opening never creates a store by surprise (issue 27, items 3 and 7).

``ckstore.open(path)`` opens a store that exists; ``create=True`` (or ``ckstore init``) makes
one, in a missing or empty folder only. A typo, a file or a foreign folder gets a typed error
that says what to do, and the command line answers with one line, never a traceback.
"""

from __future__ import annotations

import fsspec
import pytest
import torch

import ckstore
from ckstore import Snapshot, cli
from ckstore.errors import (
    ConflictError,
    DestinationExistsError,
    InvalidInputError,
    NotFoundError,
    SnapshotNotFoundError,
)
from tests.support.cli import run

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def one_line(result: tuple[int, str, str], code: int, *words: str) -> str:
    got, out, err = result
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckstore: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_a_missing_store_is_not_created_by_open(tmp_path) -> None:
    typo = tmp_path / "ckpst"
    with pytest.raises(NotFoundError, match="create=True") as exc:
        ckstore.open(typo)
    assert "ckstore init" in str(exc.value)
    assert not typo.exists()  # nothing was made at the typo
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotFoundError, match="holds no ckstore.json"):
        ckstore.open(empty)
    assert list(empty.iterdir()) == []
    with pytest.raises(NotFoundError):
        ckstore.open("memory://no-such-store-here")


def test_create_makes_a_store_in_a_new_or_empty_folder_and_opens_an_existing_one(tmp_path) -> None:
    with ckstore.open(tmp_path / "new" / "deeper", create=True, **TINY) as store:
        store.take({"m": ckstore.StateDict(w=torch.ones(4))}, run="r", step=1)
    with ckstore.open(tmp_path / "new" / "deeper", create=True) as again:  # open-or-create
        assert [s.step for s in again.log()] == [1]
    (tmp_path / "empty").mkdir()
    ckstore.open(tmp_path / "empty", create=True).close()
    assert (tmp_path / "empty" / "ckstore.json").is_file()
    with ckstore.open(tmp_path / "empty") as store:  # and from now on it simply opens
        assert store.log() == []


def test_a_non_empty_foreign_folder_or_a_file_is_refused_by_name(tmp_path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"x")
    with pytest.raises(DestinationExistsError, match="model.safetensors") as exc:
        ckstore.open(export, create=True)
    assert isinstance(exc.value, FileExistsError)
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors"]
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    with pytest.raises(InvalidInputError, match="is a file"):
        ckstore.open(a_file)
    with pytest.raises(InvalidInputError, match="is a file"):
        ckstore.open(a_file, create=True)
    with pytest.raises(InvalidInputError, match="a-file is a file"):
        ckstore.open(a_file / "sub", create=True)


def test_a_non_empty_remote_prefix_is_refused() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/foreign-prefix/notes.txt", b"someone else's")
    with pytest.raises(DestinationExistsError, match="notes.txt"):
        ckstore.open("memory://foreign-prefix", create=True)
    ckstore.open("memory://fresh-prefix-for-open-rules", create=True).close()


def test_init_under_a_file_is_one_line_with_the_usage_code(tmp_path, capsys) -> None:
    (tmp_path / "a-file").write_text("x")
    one_line(run(capsys, "init", str(tmp_path / "a-file" / "sub")), 2, "a-file is a file")
    assert (tmp_path / "a-file").read_text() == "x"
    one_line(run(capsys, "init", str(tmp_path / "a-file")), 2, "is a file")
    one_line(run(capsys, "log", "--store", str(tmp_path / "nope")), 3, "ckstore init")


def test_an_os_error_or_a_bug_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    ckstore.open(tmp_path / "s", create=True).close()

    def broken(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "s" / "index.sqlite"))

    monkeypatch.setattr(ckstore.Store, "log", broken)
    one_line(
        run(capsys, "log", "--store", str(tmp_path / "s")), 6, "Permission denied", "index.sqlite"
    )

    def bug(*args, **kwargs):
        raise TypeError("an unexpected bug")

    monkeypatch.setattr(ckstore.Store, "log", bug)
    one_line(
        run(capsys, "log", "--store", str(tmp_path / "s")), 6, "internal error", "CKSTORE_DEBUG"
    )
    monkeypatch.setenv("CKSTORE_DEBUG", "1")
    with pytest.raises(TypeError):
        cli.main(["log", "--store", str(tmp_path / "s")])


# --- item 11: unchanged TorchSnapshot code gets one store per run, not one per step -----------
def _app(step: int) -> dict[str, ckstore.StateDict]:
    torch.manual_seed(0)
    return {"model": ckstore.StateDict(w=torch.randn(64, 64), step=step)}


def test_step_paths_share_a_store_created_in_their_parent(tmp_path) -> None:
    from ckstore import Snapshot

    run1 = tmp_path / "ckpts" / "run1"
    snaps = [
        Snapshot.take(path=str(run1 / f"step_{n}"), app_state=_app(n)) for n in (100, 200, 300)
    ]
    assert (run1 / "ckstore.json").is_file() and not (run1 / "step_100").exists()
    assert snaps[0].stats["new_chunks"] > 0
    assert [s.stats["new_chunks"] for s in snaps[1:]] == [0, 0]  # the weights dedup
    dest = {"model": ckstore.StateDict(w=torch.zeros(64, 64), step=0)}
    Snapshot(path=str(run1 / "step_200")).restore(dest)
    assert dest["model"]["step"] == 200
    with ckstore.open(run1) as store:
        assert sorted(s.name for s in store.log()) == ["step_100", "step_200", "step_300"]


def test_a_foreign_parent_or_the_way_out_keeps_a_store_per_path(tmp_path, monkeypatch) -> None:
    from ckstore import Snapshot

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("# the user's code")
    Snapshot.take(path=str(project / "step_1"), app_state=_app(1))
    assert (project / "step_1" / "ckstore.json").is_file()
    assert not (project / "ckstore.json").exists()  # never a store in a folder of other things
    Snapshot.take(path=str(tmp_path / "named" / "final"), app_state=_app(1))  # not step-like
    assert (tmp_path / "named" / "final" / "ckstore.json").is_file()
    monkeypatch.setenv("CKSTORE_SHARED_PARENT", "0")
    Snapshot.take(path=str(tmp_path / "old" / "step_1"), app_state=_app(1))
    assert (tmp_path / "old" / "step_1" / "ckstore.json").is_file()
    monkeypatch.delenv("CKSTORE_SHARED_PARENT")
    # siblings that are per-step stores (an older layout): the next step starts the shared store
    Snapshot.take(path=str(tmp_path / "old" / "step_2"), app_state=_app(2))
    Snapshot.take(path=str(tmp_path / "old" / "step_3"), app_state=_app(3))
    assert (tmp_path / "old" / "ckstore.json").is_file()
    dest = {"model": ckstore.StateDict(w=torch.zeros(64, 64), step=0)}
    Snapshot(path=str(tmp_path / "old" / "step_1")).restore(dest)  # the old one still reads
    assert dest["model"]["step"] == 1
    Snapshot(path=str(tmp_path / "old" / "step_3")).restore(dest)
    assert dest["model"]["step"] == 3


def _linear(value: float) -> torch.nn.Linear:
    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.fill_(value)
        m.bias.fill_(value)
    return m


def test_a_path_opens_the_snapshot_taken_there_and_nothing_else(tmp_path) -> None:
    """A path inside a store names the snapshot taken at it. Before, its name was looked up as
    any ref: ``ckpts/eval`` opened run ``eval``'s latest, ``ckpts/<hex digits>`` any
    snapshot whose id began so (a step folder ``ckpts/1500`` could), and a tag took the name."""
    root = tmp_path / "ckpts"
    first = Snapshot.take(path=str(root / "step_100"), app_state={"m": _linear(1.0)})
    with ckstore.open(root) as store:
        store.take({"m": _linear(3.0)}, run="eval", step=5, tags=["final"])
    for never in ("eval", first.id[:8], "final", "eval@5"):
        with pytest.raises(SnapshotNotFoundError, match="no snapshot was taken at"):
            Snapshot(path=str(root / never)).restore({"m": _linear(0.0)})
    with pytest.raises(ConflictError, match="is a tag's"):  # the tag keeps its meaning
        Snapshot.take(path=str(root / "final"), app_state={"m": _linear(2.0)})
    dest = _linear(0.0)
    Snapshot(path=str(root / "step_100")).restore({"m": dest})
    assert torch.equal(dest.weight, torch.full((2, 2), 1.0))
