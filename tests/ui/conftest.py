"""Fixtures of the UI tests: one scenario store for the module (read-only tests share it; tests
that change the store get a copy), the app served in-process on 127.0.0.1, and a browser."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ui.browser import Browser, Served, serve, start_or_skip
from tests.ui.scenario import build


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The scenario store (built once) and its snapshot ids by ``run@step``."""
    path = tmp_path_factory.mktemp("ui") / "ckpts"
    return path, build(path)


@pytest.fixture
def store_copy(scenario: tuple[Path, dict[str, str]], tmp_path: Path) -> Path:
    """A copy of the scenario store that a test may change."""
    dest = tmp_path / "copy"
    shutil.copytree(scenario[0], dest)
    return dest


@pytest.fixture(scope="module")
def served(scenario: tuple[Path, dict[str, str]]) -> Iterator[Served]:
    """The UI of the scenario store (do not change the store through it)."""
    s = serve(str(scenario[0]), workdir=str(scenario[0].parent))  # the header reads "ckpts"
    yield s
    s.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    b = start_or_skip("headless chromium (Debian's chromium package)", Browser)
    yield b
    b.close()


@pytest.fixture
def writable(store_copy: Path) -> Iterator[Served]:
    """The UI of a copy of the scenario store, which its tests may change (token
    ``right-token``)."""
    s = serve(str(store_copy), token="right-token")
    yield s
    s.stop()
