"""Packaging like a library people install: license, changelog, metadata, public names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import ckstore
from tests.support.paths import REPO

ROOT = REPO
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


def test_license_metadata_is_an_spdx_expression_without_deprecation() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639
    assert "Typing :: Typed" in project["classifiers"]
    requires = PYPROJECT["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(7[7-9]|[89]\d)(\.\d+)*", r) for r in requires)
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a license table warns (SetuptoolsDeprecationWarning)
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"


def test_changelog_has_unreleased_and_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in text and "## [Unreleased]" in text
    version = PYPROJECT["project"]["version"]
    assert version == ckstore.__version__
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d\d-\d\d$", text, re.M)


def test_dir_lists_the_lazy_public_names_without_importing_them() -> None:
    code = (
        "import sys, ckstore\n"
        "names = dir(ckstore)\n"
        "missing = [n for n in ckstore.__all__ if n not in names]\n"
        "print(missing, 'ckstore.store' in sys.modules, 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    ).stdout
    assert out.strip() == "[] False False"
    assert {"Store", "open", "Snapshot", "StateDict", "dcp", "__version__"} <= set(dir(ckstore))


def test_the_ui_assets_are_in_the_wheel(tmp_path: Path) -> None:
    """`ckstore ui` serves its page from the installed package: no asset may be left out."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ckstore", src / "ckstore", ignore=shutil.ignore_patterns("__pycache__"))
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp_path / 'out')!r}))"
    (tmp_path / "out").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = tmp_path / "out" / done.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    static = ROOT / "ckstore" / "ui" / "static"
    wanted = {
        f"ckstore/ui/static/{p.relative_to(static).as_posix()}"
        for p in static.rglob("*")
        if p.is_file()
    }
    assert {
        "ckstore/ui/static/index.html",
        "ckstore/ui/static/js/main.js",
        "ckstore/ui/static/vendor/uplot/uPlot.iife.min.js",
        "ckstore/ui/static/vendor/uplot/LICENSE",
    } <= wanted
    assert wanted <= names, sorted(wanted - names)
