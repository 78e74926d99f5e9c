"""Progress of long work (issue 27, item 17): takes, restores, imports, exports and gc tell a
callback ``fn(what, done, total)`` as they advance; the command line draws bars on a terminal
and stays silent otherwise."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.cli import _format

KNOBS = {"chunk_bytes": 4096, "pack_bytes": 16384, "inline_bytes": 64}


class Told:
    """Records every call, checking each pass only moves forward and ends at its total."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, what: str, done: int, total: int) -> None:
        with self.lock:
            self.calls.append((what, done, total))

    def passes(self) -> dict[str, list[tuple[int, int]]]:
        out: dict[str, list[tuple[int, int]]] = {}
        for what, done, total in self.calls:
            out.setdefault(what, []).append((done, total))
        for what, seen in out.items():
            dones = [d for d, _ in seen]
            assert dones == sorted(dones), (what, dones)  # never backwards
            assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1], (
                what,
                seen,
            )  # from 0 to the total
        return out


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 128, generator=g), "b": torch.randn(4096, generator=g)}


def _raw(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with ckstore.open(tmp_path / "s", create=True, auto_compact=False, **KNOBS) as s:
        yield s


def test_a_take_tells_its_bytes_from_zero_to_the_state(store: Any) -> None:
    state = _state()
    for run in ("first", "again"):  # the second finds every chunk in the store: it still ends
        told = Told()
        store.take({"m": ckstore.StateDict(state)}, run=run, progress=told)
        assert told.passes()["take"][-1] == (_raw(state), _raw(state))
    told = Told()
    store.async_take({"m": ckstore.StateDict(state)}, run="later", progress=told).wait(timeout=60)
    assert told.passes()["take"][-1][0] == _raw(state)


def test_restores_tell_each_pass(store: Any) -> None:
    state = _state()
    snap = store.take({"m": ckstore.StateDict(state)}, run="r")
    told = Told()
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    snap.restore({"m": ckstore.StateDict(dest)}, progress=told, memory_budget=0)
    assert list(told.passes()) == ["verify", "restore"]
    assert all(p[-1][0] == _raw(state) for p in told.passes().values())
    told = Told()
    snap.restore({"m": ckstore.StateDict(dest)}, progress=told, atomic=False)
    assert list(told.passes()) == ["restore"]
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_an_export_and_an_import_tell_their_bytes(store: Any, tmp_path: Path) -> None:
    state = _state()
    snap = store.take({"m": ckstore.StateDict(state)}, run="r")
    told = Told()
    snap.export(tmp_path / "out", keys="m/**", progress=told)
    assert told.passes()["restore"][-1][0] == _raw(state)
    told = Told()
    back = store.import_checkpoint(tmp_path / "out", run="back", progress=told)
    assert told.passes()["take"][-1][0] == _raw(state) and back.stats["new_chunks"] == 0


def test_gc_tells_the_bytes_it_copies_out_of_sparse_packs(tmp_path: Path) -> None:
    with ckstore.open(
        tmp_path / "s", create=True, auto_compact=False, chunk_bytes=1024, pack_bytes=64 << 10
    ) as s:
        keep = torch.randn(64, 16)
        s.take({"s": ckstore.StateDict(keep=keep, big=torch.randn(128, 64))}, run="a")
        s.take({"s": ckstore.StateDict(keep=keep)}, run="b")
        s.delete("a")
        told = Told()
        report = s.gc(grace_seconds=0, repack_below=0.5, progress=told)
        assert report.packs_rewritten == 1
        assert (
            told.passes()["gc"][-1][0] > 0
        )  # the stored bytes of the chunks still live in the pack


def test_a_callback_that_raises_cancels_the_take(store: Any) -> None:
    def stop(what: str, done: int, total: int) -> None:
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.take({"m": ckstore.StateDict(_state())}, run="r", progress=stop)
    assert store.log() == [] and store.repository.index.held_sessions() == []


def test_bars_on_a_terminal_and_silence_elsewhere(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = store.take({"m": ckstore.StateDict(_state())}, run="r")
    assert _format.bar() is None  # stderr is captured: not a terminal
    assert (
        cli.main(["--store", str(tmp_path / "s"), "export", snap.ref, str(tmp_path / "quiet")]) == 0
    )
    assert "restore" not in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert (
        cli.main(["--store", str(tmp_path / "s"), "export", snap.ref, str(tmp_path / "loud")]) == 0
    )
    assert "export" in screen.getvalue() and "B/s" in screen.getvalue()  # what was asked for
