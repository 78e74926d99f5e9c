"""The code base stays lint-clean (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO


def test_ruff_check_is_clean():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--output-format",
            "concise",
            "ckstore",
            "tests",
            "bench",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean():
    """The package type-checks (configured in pyproject.toml; it ships py.typed)."""
    assert (ROOT / "ckstore" / "py.typed").is_file()
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_test_folder_is_collected():
    """Every test folder is collected (pytest skips folders named like build outputs)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = {
        line.split("::")[0].split("/")[1] for line in out.stdout.splitlines() if "::" in line
    }
    folders = {
        p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))
    }
    assert folders <= collected, (folders - collected, out.stdout[-2000:])


def test_ruff_lints_every_python_file():
    """Ruff lints every Python file of the package, the tests and the bench."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "ckstore", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    linted = {
        Path(line.strip()).resolve()
        for line in out.stdout.splitlines()
        if line.strip().endswith(".py")
    }
    wanted = {
        p.resolve()
        for d in ("ckstore", "tests", "bench")
        for p in (ROOT / d).rglob("*.py")
        if "out" not in p.parts
    }
    assert wanted <= linted, sorted(str(p.relative_to(ROOT)) for p in wanted - linted)
