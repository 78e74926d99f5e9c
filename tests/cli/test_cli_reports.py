"""What the command line prints: whole names in reports, help text, JSON errors (issue 27).

Most calls run the CLI in this process (``cli.main``); the output is the point of each test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.cli._common import report_lines
from tests.support.cli import run

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture(autouse=True)
def _no_store_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.STORE_ENV, raising=False)


def _store(path: Path, runs: tuple[str, ...] = ("py-reimport",), steps: int = 2) -> None:
    with ckstore.open(path, create=True, **TINY) as store:
        for run_name in runs:
            for step in range(1, steps + 1):
                torch.manual_seed(step)
                store.take({"m": ckstore.StateDict(w=torch.randn(4, 64))}, run=run_name, step=step)


# --- item 2: list items are printed whole ------------------------------------------------------
def test_report_lists_are_not_cut_to_twelve_characters() -> None:
    lines = report_lines({"files": ["model.safetensors", "model.safetensors.index.json"]}, "")
    assert lines == ["files: 2 (model.safetensors, model.safetensors.index.json)"]
    many = report_lines(
        {"snapshots_dropped": [f"py-reimport@{i} (abcdef012345)" for i in range(12)]}, ""
    )
    assert many[0].startswith("snapshots_dropped: 12 (py-reimport@0 (abcdef012345), ")
    assert many[0].endswith("py-reimport@9 (abcdef012345), ... 2 more)")


def test_gc_and_export_reports_name_things_whole(tmp_path: Path, capsys) -> None:
    store = tmp_path / "store"
    _store(store)
    code, out, err = run(capsys, "--store", str(store), "gc", "--keep-last", "1")
    assert code == 0, err
    assert "snapshots_dropped: 1 (py-reimport@1)" in out
    code, out, err = run(
        capsys, "--store", str(store), "export", "py-reimport", str(tmp_path / "hf")
    )
    assert code == 0, err
    assert "model.safetensors" in out and "model.safete," not in out and "model.safete)" not in out


# --- item 13: --json covers errors too ---------------------------------------------------------
def test_json_errors_are_one_document_on_stdout_with_the_same_exit_codes(tmp_path, capsys) -> None:
    store = tmp_path / "store"
    _store(store, runs=("r",), steps=1)
    s = ("--store", str(store))
    cases = [
        (("show", "nope", "--json", *s), 3, "SnapshotNotFoundError", "nope"),
        (("log", "-n", "x", "--json", *s), 2, "UsageError", "non-negative"),
        (("--json", "tag", "r@1", "a b", *s), 2, "InvalidInputError", "'a b'"),
        (
            ("log", "--json", "--store", str(tmp_path / "missing")),
            3,
            "NotFoundError",
            "ckstore init",
        ),
    ]
    for argv, code, kind, word in cases:
        got, out, err = run(capsys, *argv)
        assert got == code, (argv, got, out, err)
        doc = json.loads(out)
        assert doc["error"]["type"] == kind and doc["error"]["exit_code"] == code
        assert word in doc["error"]["message"]
        assert err.startswith("ckstore: error: ") and len(err.strip().splitlines()) == 1
    run(capsys, "tag", "r@1", "best", *s)
    got, out, _ = run(capsys, "tag", "r@1", "best", "--json", *s)
    assert got == 4 and json.loads(out)["error"]["type"] == "ConflictError"
    got, out, err = run(capsys, "show", "nope", *s)  # without --json: stderr only, as before
    assert got == 3 and out == "" and err.startswith("ckstore: error: ")
