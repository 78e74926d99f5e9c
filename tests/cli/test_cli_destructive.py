"""The command line's destructive verbs, given what users type by mistake: the store's own
folder as an export's destination, two refs to one snapshot."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckstore
from tests.support.cli import run


def _store(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ckstore.open(path, create=True) as store:
            m = torch.nn.Linear(2, 2)
            for s in (1, 2, 3):
                with torch.no_grad():
                    m.weight.add_(1.0)
                store.take({"m": m}, run="r", step=s)
            store.tag("r@1", "best")


def test_export_force_onto_the_store_itself_refuses_and_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 0, a successful export reported, and the store deleted."""
    path = tmp_path / "ckpts"
    _store(path)
    code, _out, err = run(capsys, "--store", str(path), "export", "best", str(path), "--force")
    assert code != 0 and "which the store exported from uses" in err, (code, err)
    with ckstore.open(path) as store:
        assert [s.step for s in store.log()] == [3, 2, 1]


@pytest.mark.parametrize("refs", [("r@3", "r", "r@2"), ("r@2", "r@2")])
def test_rm_of_two_refs_to_one_snapshot_deletes_each_once_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refs: tuple[str, ...]
) -> None:
    """Before: ``rm r@3 r r@2`` deleted r@3, then failed on ``r`` ("no snapshot matches",
    exit 3) without a word of the deletion, and left r@2."""
    path = tmp_path / "s"
    _store(path)
    code, out, err = run(capsys, "--store", str(path), "rm", *refs)
    assert code == 0, err
    gone = {int(r.split("@")[1]) if "@" in r else 3 for r in refs}
    with ckstore.open(path) as store:
        assert [s.step for s in store.log()] == [s for s in (3, 2, 1) if s not in gone]
    for step in gone:
        assert f"r@{step}" in out, out


def test_rm_of_one_run_named_twice_deletes_it_once_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the run deleted, then "no run 'r'" and exit 3, nothing said of the deletion."""
    path = tmp_path / "s"
    _store(path)
    code, out, err = run(
        capsys, "--store", str(path), "rm", "--run", "r", "--run", "r", "--yes", "--force"
    )
    assert code == 0, err
    with ckstore.open(path) as store:
        assert store.runs() == []
    assert out.count("deleted run r:") == 1, out
