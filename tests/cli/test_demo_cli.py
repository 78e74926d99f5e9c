"""``ckstore demo`` with unusual schedules, a failing resume, and ``--json`` (issue 27, items 4, 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckstore
from ckstore import cli
from ckstore.cli import demo
from ckstore.errors import CkstoreError, InvalidInputError
from tests.support.paths import REPO


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_schedule_with_nothing_to_resume_from_is_a_usage_error(tmp_path, capsys) -> None:
    for steps, every in (("3", "5"), ("1", "1"), ("10", "0"), ("10", "6")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--store", str(tmp_path / "d"), "demo", "--steps", steps, "--every", every])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("ckstore: error: --steps must be at least 2") and "Traceback" not in err
        )
    assert not (tmp_path / "d").exists()  # refused before the folder was claimed
    with pytest.raises(InvalidInputError):
        demo.check_schedule(3, 5)


def test_a_failed_resume_names_the_childs_error(tmp_path) -> None:
    ckstore.open(tmp_path / "empty", create=True).close()
    with pytest.raises(CkstoreError, match="resume process failed") as exc:
        demo.resume_elsewhere(str(tmp_path / "empty"), 4)
    assert "no snapshot matches 'demo'" in str(exc.value)


def test_a_failing_history_command_fails_the_demo() -> None:
    result = demo.DemoResult("x", steps=4, every=1, resumed_steps=2, identical_steps=2)
    result.commands = [{"command": ["ckstore", "log"], "exit_code": 0}]
    assert result.bit_identical and result.exit_code == 0
    result.commands.append({"command": ["ckstore", "diff"], "exit_code": 3})
    assert result.exit_code == 3
    assert demo.DemoResult("x", steps=4, every=1, resumed_steps=2, identical_steps=1).exit_code == 1


def test_demo_json_with_one_snapshot(tmp_path) -> None:
    """``--steps 10 --every 5`` takes one snapshot: no diff to show, nothing fails, exit 0."""
    p = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(tmp_path / "d"), "demo", "--steps", "10",
         "--every", "5", "--json"],
        capture_output=True, text=True, env=_env(), timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr == ""
    d = json.loads(p.stdout)  # one JSON document, no transcript around it
    assert d["bit_identical"] is True and d["resumed_at"] == 5 and d["resumed_steps"] == 5
    assert [s["step"] for s in d["snapshots"]] == [5] and d["snapshots"][0]["new_chunks"] > 0
    assert [c["command"][1] for c in d["commands"]] == [
        "log",
        "tag",
        "du",
        "gc",
        "log",
        "du",
        "check",
    ]
    assert all(c["exit_code"] == 0 for c in d["commands"])
    assert d["commands"][-1]["output"]["ok"] is True
    assert d["commands"][0]["output"][0]["step"] == 5
