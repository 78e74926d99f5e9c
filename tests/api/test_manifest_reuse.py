"""A store handle parses a snapshot's manifest once for every ``get`` of it: a loop of
``store.get(ref).read_object(key)`` pays the parse once, and what one read hands back (dicts,
lists, BytesIO values) is never the object another read gets."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.engine import manifests, view


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts manifest parses: whole (``engine.manifests.load``) and for a header alone."""
    calls: list[int] = []
    for module, name in ((manifests, "load"), (view, "parse_any")):
        real = getattr(module, name)

        def counted(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def _state(step: int) -> ckstore.StateDict:
    return ckstore.StateDict(
        {
            "w": torch.full((64, 64), float(step)),
            "cfg": {"lr": [0.1, 0.2], "name": "run"},
            "blob": io.BytesIO(b"payload"),
        }
    )


def test_every_get_of_one_snapshot_parses_its_manifest_once(tmp_path: Path, parses: list[int]):
    with ckstore.open(tmp_path / "s", create=True) as s:
        s.take({"a": _state(0)}, run="r", step=0)
        s.take({"a": _state(1)}, run="r", step=1)
        for _ in range(5):
            assert float(s.get("r@0").read_object("a/w")[0, 0]) == 0.0
        assert s.get("r@0").health is not None  # its header too
        assert len(parses) == 1
        for _ in range(3):  # another snapshot takes its place; the first is parsed again after
            assert float(s.get("r@1").read_object("a/w")[0, 0]) == 1.0
        assert float(s.get("r@0").read_object("a/w")[0, 0]) == 0.0
        assert len(parses) == 3
        s.take({"a": _state(2)}, run="r", step=2)  # a take lets the kept one go
        s.get("r@0").read_object("a/w")
        assert len(parses) == 4
    with ckstore.open(tmp_path / "s") as s:  # a new handle parses for itself
        s.get("r@0").read_object("a/w")
        assert len(parses) == 5


def test_what_a_read_hands_back_is_its_own(tmp_path: Path, parses: list[int]):
    with ckstore.open(tmp_path / "s", create=True) as s:
        s.take({"a": _state(0)}, run="r", step=0)
        first = s.get("r@0").read_object("a")
        first["cfg"]["lr"].append(9.9)
        first["cfg"]["name"] = "changed"
        assert first["blob"].read() == b"payload"  # its position is now at the end
        first["w"].add_(1)

        again = s.get("r@0").read_object("a")
        assert again["cfg"] == {"lr": [0.1, 0.2], "name": "run"}
        assert again["blob"].read() == b"payload"
        assert float(again["w"][0, 0]) == 0.0

        dest = ckstore.StateDict({"w": torch.zeros(64, 64), "cfg": None, "blob": None})
        s.get("r@0").restore({"a": dest})
        assert dest["cfg"] == {"lr": [0.1, 0.2], "name": "run"}
        assert dest["cfg"] is not again["cfg"]
        assert dest["blob"].read() == b"payload"
        assert len(parses) == 1
