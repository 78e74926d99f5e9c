"""Where things are: the repository root, for tests that run its files or read its docs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root (holds ``pyproject.toml``, ``ckstore/``, ``docs/``, ``tests/``)."""
