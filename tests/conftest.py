"""Shared fixtures: stores with tiny knobs so small tensors take multi-chunk, multi-pack paths."""

from __future__ import annotations

import pytest

import ckstore

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    s = ckstore.open(store_path, **TINY)
    yield s
    s.close()
