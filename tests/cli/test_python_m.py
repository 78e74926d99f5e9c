"""``python -m ckstore`` runs the command line (where the ``ckstore`` script is not on PATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO


def test_python_m_ckstore_runs_the_cli(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CKSTORE_STORE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    store = str(tmp_path / "s")
    out = subprocess.run(
        [sys.executable, "-m", "ckstore", "--store", store, "init"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "ckstore", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert usage.returncode == 0 and usage.stdout.startswith("usage: ckstore"), usage.stdout[:200]
    bad = subprocess.run(
        [sys.executable, "-m", "ckstore", "--store", store, "show", "nothing"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode != 0 and "ckstore: error:" in bad.stderr  # exit codes as the script's
