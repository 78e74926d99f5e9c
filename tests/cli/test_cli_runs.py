"""Whole runs and destructive policies (issue 27, items 10, 16 and 20).

``rm --run NAME`` deletes a run (asking on a terminal, tags refused without ``--force``); ``du``
says what that would free (bytes only that run references); ``gc`` asks on a terminal before
leaving a run without snapshots (``--keep-last 0``), and ``gc --help`` shows its defaults.
"""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.cli import _common, _maintenance
from ckstore.history import gc as gc_mod
from tests.support.cli import run

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch):
    """A person at a terminal who answers with the strings in ``answers`` (then fails)."""
    answers: list[str] = []
    asked: list[str] = []
    monkeypatch.setattr(_common, "is_terminal", lambda: True)

    def fake_input(prompt: str = "") -> str:
        asked.append(prompt)
        return answers.pop(0)

    monkeypatch.setattr(builtins, "input", fake_input)
    return answers, asked


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """Runs ``a`` and ``b`` share a 4 KiB tensor; each has one of its own (a: 2 KiB, b: 3 KiB)."""
    path = tmp_path / "s"
    torch.manual_seed(0)
    shared, only_a, only_b = torch.randn(1024), torch.randn(512), torch.randn(768)
    with ckstore.open(path, create=True, **TINY) as store:
        store.take({"m": ckstore.StateDict(s=shared, x=only_a)}, run="a", step=1, tags=["a-best"])
        store.take({"m": ckstore.StateDict(s=shared, x=only_a)}, run="a", step=2)
        store.take({"m": ckstore.StateDict(s=shared, x=only_b)}, run="b", step=1)
    return path


def _chunk_bytes(store: ckstore.Store, runs: tuple[str, ...]) -> dict[str, int]:
    ids = {
        r: set().union(*(store.repository.index.snapshot_chunk_ids(s.id) for s in store.log(run=r)))
        for r in runs
    }
    locs = store.repository.index.chunk_locations(set().union(*ids.values()))
    return {
        r: sum(locs[c].length for c in ids[r] - set().union(*(ids[o] for o in runs if o != r)))
        for r in runs
    }


def test_du_says_what_deleting_a_run_frees(two_runs, capsys) -> None:
    with ckstore.open(two_runs) as store:
        expected = _chunk_bytes(store, ("a", "b"))
    assert expected["a"] > 0 and expected["b"] > 0
    code, out, _ = run(capsys, "--store", str(two_runs), "du", "--json")
    rows = {r["run"]: r for r in json.loads(out)["runs"]}
    assert code == 0 and {r: rows[r]["exclusive_bytes"] for r in rows} == expected
    assert (
        rows["a"]["exclusive_bytes"] < rows["a"]["stored_bytes"]
    )  # the shared tensor is not counted
    code, out, _ = run(capsys, "--store", str(two_runs), "du")
    assert "exclusive" in out.splitlines()[0] and "ckstore rm --run RUN" in out


def test_rm_run_asks_refuses_tags_and_frees_what_du_said(two_runs, capsys, terminal) -> None:
    answers, asked = terminal
    s = ("--store", str(two_runs))
    with ckstore.open(two_runs) as store:
        frees = _chunk_bytes(store, ("a", "b"))["a"]
    code, _, err = run(capsys, *s, "rm", "--run", "a")
    assert code == 4 and "a-best" in err and "--force" in err
    answers.append("n")
    code, _, err = run(capsys, *s, "rm", "--run", "a", "--force")
    assert code == 0 and "nothing deleted" in err and "delete run a (2 snapshots" in err and asked
    answers.append("y")
    code, out, _ = run(capsys, *s, "rm", "--run", "a", "--force")
    assert code == 0 and "deleted run a: 2 snapshots and their tags a-best" in out
    with ckstore.open(two_runs) as store:
        assert store.runs() == ["b"] and store.tags() == {}
        report = store.gc(grace_seconds=0)
        assert report.chunk_bytes_removed == frees  # exactly what du said
        assert store.check(read_data=True).ok
    code, _, err = run(capsys, *s, "rm", "--run", "a", "--yes")
    assert code == 3 and "no run 'a'" in err
    code, _, err = run(capsys, *s, "rm")
    assert code == 2 and "--run NAME" in err


def test_rm_run_without_a_terminal_does_not_ask(two_runs, capsys) -> None:
    code, out, _ = run(capsys, "--store", str(two_runs), "rm", "--run", "b", "--json")
    assert code == 0 and list(json.loads(out)["runs"]) == ["b"]


def test_gc_keep_last_zero_asks_on_a_terminal(two_runs, capsys, terminal) -> None:
    answers, asked = terminal
    s = ("--store", str(two_runs))
    answers.append("no")
    code, _, err = run(
        capsys, *s, "gc", "--keep-last", "0", "--no-keep-healthy"
    )  # (the newest healthy stays otherwise)
    assert code == 0 and "nothing deleted" in err
    assert "every snapshot of b (1)" in err and "[y/N]" in err  # a keeps its tagged snapshot
    with ckstore.open(two_runs) as store:
        assert len(store.log()) == 3
    code, _, _ = run(
        capsys, *s, "gc", "--keep-last", "1"
    )  # leaves every run a snapshot: no question
    assert code == 0 and len(asked) == 1
    answers.append("y")
    code, out, _ = run(capsys, *s, "gc", "--keep-last", "0", "--no-keep-healthy")
    assert code == 0 and "snapshots_dropped: 2 (b@1, a@2)" in out
    code, out, _ = run(
        capsys, *s, "gc", "--keep-last", "0", "--no-keep-tagged", "--no-keep-healthy", "--yes"
    )
    assert code == 0 and "a@" in out and len(asked) == 2  # --yes: not asked


def test_gc_help_shows_its_defaults(capsys) -> None:
    assert gc_mod.DEFAULT_GRACE_SECONDS == 6 * 3600 and _maintenance.GC_GRACE_DEFAULT == "6h"
    assert gc_mod.DEFAULT_REPACK_BELOW == _maintenance.GC_REPACK_DEFAULT
    code, out, _ = run(capsys, "gc", "--help")
    text = " ".join(out.split())
    assert code == 0 and "(default: 6h;" in text and "(default: 0.5;" in text
    assert "default: a tag keeps its snapshot" in text and "--yes" in text
