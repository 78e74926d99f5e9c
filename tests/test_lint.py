"""The code base stays lint-clean (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "ckstore", "tests", "bench"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
