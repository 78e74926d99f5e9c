"""A torchtitan-style trainer with no override: plain ``step-N`` paths in a folder marked for
ckstore save, list, purge and resume through the store.

The checkpointer (``folder_scenarios.TitanCheckpointer``) is torchtitan's file-system logic:
``os.listdir`` + ``isfile(<step>/.metadata)`` to find the step, ``shutil.rmtree`` in a thread
for ``keep_latest_k``, ``dcp.save`` / ``dcp.load`` with ``os.path.join(folder, f"step-{n}")``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp  # noqa: E402  (ships with the torch we pin)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import ckstore
from ckstore.cli import main as cli
from ckstore.dcp import forget_removed, mark_folder
from ckstore.dcp.folder import MARKER_NAME, read_marker, read_pointer
from ckstore.errors import CheckpointNotFoundError, ConflictError
from ckstore.store_ref import opened
from tests.dcp import folder_scenarios as fs
from tests.dcp import scenarios as ds
from tests.support.paths import REPO
from tests.support.ranks import run_ranks, values

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _App(fs.TitanApp):
    """torchtitan's training state, loaded through the checkpointer."""

    def load(self, ckpt: fs.TitanCheckpointer, step: int) -> None:
        state = self.state()
        ckpt.load(step, state)
        self.put(state)


def _store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    ckstore.open(url, **ds.TINY, create=True).close()
    return url


def _steps(url: str, run: str = "titan") -> list[int]:
    with ckstore.open(url) as store:
        return sorted(int(s.step or 0) for s in store.log(run))


def _packs_bytes(url: str) -> int:
    return sum(
        p.stat().st_size for p in Path(url).rglob("*") if p.is_file() and "index" not in p.name
    )


def _reclaimed(url: str) -> None:
    """Wait for the space a save's purge freed: given back behind the save."""
    writer_store = opened(url)
    if writer_store is not None:
        assert writer_store.wait_compacted(timeout=60)


def test_a_torchtitan_checkpointer_saves_lists_purges_and_resumes(tmp_path: Path) -> None:
    url = _store(tmp_path)
    folder = str(tmp_path / "outputs" / "checkpoint")
    mark_folder(folder, url, run="titan")
    ckpt = fs.TitanCheckpointer(folder, keep_latest_k=2)
    assert ckpt.find_load_step() == -1  # the marker is no step
    app = _App()
    sizes = {}
    for step in range(1, 7):
        app.train()
        ckpt.save(step, app.state(), use_async=step == 4)
        # the save learned the previous purge: the store holds exactly what the folder lists
        assert _steps(url) == ckpt.listed() == list(range(max(1, step - 2), step + 1))
        _reclaimed(url)
        sizes[step] = _packs_bytes(url)
        ckpt.purge_stale_checkpoints()
        assert ckpt.listed() == list(range(max(1, step - 1), step + 1))
    assert sizes[6] < 1.3 * sizes[3]  # three snapshots' worth, not six: the space came back
    with ckstore.open(url) as store:
        assert store.check(read_data=True).ok
        assert not store.repository.index.live_sessions()
    resumed = _App(seed=9)
    resumed.load(fs.TitanCheckpointer(folder), fs.TitanCheckpointer(folder).find_load_step())
    assert resumed.same_as(app) and resumed.step == 6


def test_a_save_gives_a_purge_back_behind_it_not_on_the_trainers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous ``dcp.save`` deletes the steps the trainer removed before it returns, but
    the gc that gives their space back (it waits for the compaction, then may rewrite packs)
    runs on the store's background thread."""
    url = _store(tmp_path)
    folder = str(tmp_path / "ckpt")
    mark_folder(folder, url, run="titan")
    ran_on: list[str] = []
    real_gc = ckstore.Store.gc

    def gc(self: ckstore.Store, *args: Any, **kwargs: Any) -> Any:
        ran_on.append(threading.current_thread().name)
        return real_gc(self, *args, **kwargs)

    monkeypatch.setattr(ckstore.Store, "gc", gc)

    def save(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.randn(64 * 1024, generator=g)}  # 256 KiB a step, incompressible
        dcp.save(state, checkpoint_id=os.path.join(folder, f"step-{step}"))

    save(1)
    save(2)
    two = _packs_bytes(url)
    shutil.rmtree(os.path.join(folder, "step-1"))
    save(3)
    assert _steps(url) == [2, 3]  # deleted before the save returned
    _reclaimed(url)
    assert ran_on == ["ckstore-compact"]  # given back behind it, never on this thread
    assert _packs_bytes(url) < 1.25 * two  # two steps' worth again, not three


def test_a_purge_that_parses_every_name_in_the_folder_meets_the_marker_as_step_0(
    tmp_path: Path,
) -> None:
    """torchtitan's releases before it filtered names (and trainers copied from them) take
    ``int(re.search(r"step-(\\d+)", name).group(1))`` of every name in the folder: the marker
    reads as step 0, is queued first, survives ``rmtree(..., ignore_errors=True)`` as a file,
    and the steps kept are the same as without it."""
    url = _store(tmp_path)
    folder = str(tmp_path / "ckpt")
    mark_folder(folder, url, run="titan")
    ckpt = fs.TitanCheckpointer(folder, keep_latest_k=2, filter_names=False)
    app = _App()
    for step in range(1, 6):
        app.train()
        ckpt.save(step, app.state())
        ckpt.purge_stale_checkpoints()
        assert ckpt.listed() == list(range(max(1, step - 1), step + 1))
        assert read_marker(folder) is not None  # still marked
    assert ckpt.find_load_step() == 5 and _steps(url) == [3, 4, 5]  # step 3 leaves at the next save
    resumed = _App(seed=9)
    resumed.load(ckpt, 5)
    assert resumed.same_as(app)


def test_two_gloo_ranks_save_purge_and_resume_through_a_marked_folder(tmp_path: Path) -> None:
    url = _store(tmp_path)
    folder = str(tmp_path / "checkpoint")
    mark_folder(folder, url, run="titan")
    got = values(run_ranks(fs.titan_ranks, 2, tmp_path, folder, url, timeout=240))
    assert [g["step"] for g in got] == [5, 5]
    assert got[0]["held"] == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert got[0]["held"] == got[0]["listed"]
    assert _steps(url) == [3, 4, 5]  # the last purge is learned by the next save


def test_a_removed_step_is_never_loaded_and_leaves_the_store_at_the_next_save(
    tmp_path: Path,
) -> None:
    url = _store(tmp_path)
    folder = str(tmp_path / "ckpt")
    mark_folder(folder, url, run="titan")
    ckpt, app = fs.TitanCheckpointer(folder), _App()
    for step in (1, 2):
        app.train()
        ckpt.save(step, app.state())
    shutil.rmtree(os.path.join(folder, "step-2"))
    assert _steps(url) == [1, 2]  # not learned yet, but never loaded by its path:
    with pytest.raises(CheckpointNotFoundError, match="step-2 holds no .metadata"):
        _App().load(ckpt, 2)
    assert ckpt.find_load_step() == 1
    app.train()
    ckpt.save(3, app.state())
    assert _steps(url) == [1, 3]


def test_a_load_reads_the_snapshot_its_pointer_names_and_nothing_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _store(tmp_path)
    folder = str(tmp_path / "ckpt")
    mark_folder(folder, url, run="titan")
    ckpt, app = fs.TitanCheckpointer(folder), _App()
    app.train()
    ckpt.save(1, app.state())
    pointer = read_pointer(os.path.join(folder, "step-1"))
    assert pointer is not None
    raw = Path(folder, "step-1", ".metadata").read_text()
    assert json.loads(raw)["snapshot"] == pointer.snapshot and "ckstore.dcp" in raw
    app.train()
    dcp.save(app.state(), checkpoint_id=f"ckstore://{url}/titan@1")  # a newer titan@1
    with ckstore.open(url) as store:
        assert store.get("titan@1").id != pointer.snapshot
    # DCP's own reader (a process without ckstore) fails on the pointer's first byte
    with pytest.raises(CheckpointException, match="invalid load key"):
        dcp.load(app.state(), storage_reader=FileSystemReader(os.path.join(folder, "step-1")))

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle used while loading")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    loaded = _App(seed=3)
    loaded.load(ckpt, 1)
    assert loaded.step == 1  # the pointer's snapshot, by id, not the newer titan@1


def test_an_unmarked_folder_still_goes_to_dcps_file_system_writer(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    ckpt, app = fs.TitanCheckpointer(str(folder)), _App()
    app.train()
    ckpt.save(1, app.state())
    assert sorted(p.name for p in (folder / "step-1").iterdir()) == [".metadata", "__0_0.distcp"]
    with open(folder / "step-1" / ".metadata", "rb") as f:
        assert type(pickle.load(f)).__name__ == "Metadata"  # DCP's own format, unchanged
    loaded = _App(seed=4)
    loaded.load(ckpt, 1)
    assert loaded.same_as(app)
    # a step folder saved by DCP before its folder was marked is still DCP's to read
    mark_folder(folder, _store(tmp_path), run="titan")
    again = _App(seed=5)
    again.load(ckpt, 1)
    assert again.same_as(app)


def _run(code: str, cwd: Path, *launch: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, *launch, *([] if launch else ["-c", code])],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_a_crash_between_commit_and_pointer_leaves_the_step_unlisted(tmp_path: Path) -> None:
    url = _store(tmp_path)
    folder = tmp_path / "ckpt"
    mark_folder(folder, url, run="titan")
    ckpt, app = fs.TitanCheckpointer(str(folder)), _App()
    app.train()
    ckpt.save(1, app.state())
    code = textwrap.dedent(
        f"""
        import os, torch, torch.distributed.checkpoint as dcp
        import ckstore.dcp.folder_writer as fw
        fw.write_pointer = lambda *a: os._exit(9)  # killed right after the commit
        dcp.save({{"w": torch.ones(300)}}, checkpoint_id={str(folder / "step-2")!r})
        """
    )
    done = _run(code, tmp_path)
    assert done.returncode == 9, done.stderr[-2000:]
    assert _steps(url) == [1, 2] and ckpt.listed() == [1] and ckpt.find_load_step() == 1
    with ckstore.open(url) as store:
        assert store.check(read_data=True).ok
    app.train()
    ckpt.save(3, app.state())  # the unlisted step 2 goes, as a removed one
    assert _steps(url) == [1, 3]


def test_other_folders_runs_and_plain_snapshots_are_never_deleted(tmp_path: Path) -> None:
    url = _store(tmp_path)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mark_folder(a, url, run="titan")
    mark_folder(b, url, run="titan")
    ca, cb, app = fs.TitanCheckpointer(a), fs.TitanCheckpointer(b), _App()
    for step in (1, 2):
        ca.save(step, app.state())
        cb.save(10 + step, app.state())
    dcp.save(app.state(), checkpoint_id=f"ckstore://{url}/titan@50")  # plain ckstore calls
    with ckstore.open(url) as store:
        store.take({"m": app.model}, run="titan", step=60)
    shutil.rmtree(b)  # a whole folder gone, marker with it: its snapshots stay
    shutil.rmtree(os.path.join(a, "step-1"))
    ca.save(3, app.state())
    assert _steps(url) == [2, 3, 11, 12, 50, 60]
    # re-marked: the old marker's snapshots are never deleted through the folder
    with pytest.raises(ConflictError, match="replace=True"):
        mark_folder(a, url, run="other")
    mark_folder(a, url, run="titan", replace=True)
    shutil.rmtree(os.path.join(a, "step-2"))
    ca.save(4, app.state())
    assert _steps(url) == [2, 3, 4, 11, 12, 50, 60]
    # a copy deletes nothing until marked, then has an identity of its own
    c = str(tmp_path / "c")
    shutil.copytree(a, c)
    shutil.rmtree(os.path.join(c, "step-4"))
    assert forget_removed(c).paused and _steps(url) == [2, 3, 4, 11, 12, 50, 60]
    assert mark_folder(c, url, run="titan").id != read_marker(a).id  # type: ignore[union-attr]
    assert forget_removed(c).deleted == () and _steps(url) == [2, 3, 4, 11, 12, 50, 60]


def test_a_moved_folder_keeps_its_identity_when_marked_again(tmp_path: Path) -> None:
    url = _store(tmp_path)
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    first = mark_folder(old, url, run="titan")
    assert mark_folder(old, url, run="titan") == first  # marking again changes nothing
    ckpt, app = fs.TitanCheckpointer(old), _App()
    for step in (1, 2):
        ckpt.save(step, app.state())
    os.rename(old, new)
    moved = mark_folder(new, url, run="titan")
    assert moved.id == first.id and moved.folder == os.path.realpath(new)
    shutil.rmtree(os.path.join(new, "step-1"))
    assert len(forget_removed(new).deleted) == 1 and _steps(url) == [2]


def test_the_launcher_installs_ckstore_for_a_trainer_that_never_imports_it(
    tmp_path: Path,
) -> None:
    url = _store(tmp_path)
    trainer = textwrap.dedent(
        """
        import json, os, sys, torch
        import torch.distributed.checkpoint as dcp
        folder = sys.argv[1]
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=os.path.join(folder, "step-1"))
        out = {"w": torch.zeros(6)}
        dcp.load(out, checkpoint_id=os.path.join(folder, "step-1"))
        assert torch.equal(out["w"], torch.arange(6.0))
        with open(os.path.join(folder, "step-1", ".metadata"), "rb") as f:
            head = f.read(1)
        print(json.dumps({"pointer": head == b"{", "argv0": os.path.basename(sys.argv[0])}))
        """
    )
    (tmp_path / "trainmod.py").write_text(trainer)
    forms = {
        "module": ("-m", "ckstore.dcp.launch", "-m", "trainmod"),
        "script": ("-m", "ckstore.dcp.launch", str(tmp_path / "trainmod.py")),
        "bare": ("-m", "trainmod"),  # without the launcher: DCP's own files
    }
    for i, (form, launch) in enumerate(forms.items()):
        folder = tmp_path / f"ckpt{i}"
        mark_folder(folder, url, run=f"titan{i}")
        done = _run("", tmp_path, *launch, str(folder))
        assert done.returncode == 0, (form, done.stderr[-3000:])
        said = json.loads(done.stdout.strip().splitlines()[-1])
        assert said == {"pointer": form != "bare", "argv0": "trainmod.py"}, form
        assert _steps(url, f"titan{i}") == ([] if form == "bare" else [1])
    assert _run("", tmp_path, "-m", "ckstore.dcp.launch").returncode == 2


def test_the_command_line_marks_and_syncs_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _store(tmp_path)
    folder = tmp_path / "ckpt"
    assert cli(["mark-folder", str(folder), "--store", url, "--run", "titan"]) == 0
    assert "marked" in capsys.readouterr().out and (folder / MARKER_NAME).is_file()
    assert cli(["mark-folder", str(folder), "--store", url, "--run", "x"]) == 4  # conflict
    ckpt, app = fs.TitanCheckpointer(str(folder)), _App()
    for step in (1, 2):
        app.train()
        ckpt.save(step, app.state())
    shutil.rmtree(folder / "step-1")
    capsys.readouterr()
    assert cli(["sync-folder", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["deleted"]) == 1 and report["paused"] is None
    assert report["purged_now"] > 0 and _steps(url) == [2]


def test_a_save_beside_another_does_not_delete_its_snapshot_before_its_pointer_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two saves into one marked folder at once (another thread, an async save, another job):
    save B has committed step 2 and is about to write its pointer when save A of step 3 runs
    through, commit and retention. B holds a write session from before its commit until its
    pointer is written, named in its step folder, and A leaves that step alone; before, A took
    B's step for a removed one and deleted it, and B's pointer then named a snapshot that was
    gone."""
    import importlib

    folder_writer = importlib.import_module("ckstore.dcp.folder_writer")
    url, folder = fs.marked_titan(tmp_path)
    state = fs.step_state
    real = folder_writer.write_pointer
    beside: list[int] = []

    def write_pointer(at: Any, pointer: Any) -> Any:  # step 2 committed; its pointer is next
        if at.step == 2 and not beside:
            beside.append(3)
            dcp.save(state(3), checkpoint_id=os.path.join(folder, "step-3"))
        return real(at, pointer)

    monkeypatch.setattr(folder_writer, "write_pointer", write_pointer)
    dcp.save(state(2), checkpoint_id=os.path.join(folder, "step-2"))
    monkeypatch.setattr(folder_writer, "write_pointer", real)
    assert beside
    with ckstore.open(url) as store:
        assert sorted(int(s.step or 0) for s in store.log("titan")) == [1, 2, 3]
    for step in (1, 2, 3):
        out = {"w": torch.zeros(4096)}
        dcp.load(out, checkpoint_id=os.path.join(folder, f"step-{step}"))
        assert torch.equal(out["w"], state(step)["w"])
    # a step folder the trainer removes is still forgotten by the next save
    shutil.rmtree(os.path.join(folder, "step-1"))
    dcp.save(state(4), checkpoint_id=os.path.join(folder, "step-4"))
    with ckstore.open(url) as store:
        assert sorted(int(s.step or 0) for s in store.log("titan")) == [2, 3, 4]
