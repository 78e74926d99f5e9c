"""Reads in a forked child never share memory with its parent or its siblings.

A process that read chunks on its main thread holds recycled read buffers there; children it
forks afterwards (DataLoader workers, launchers that fork ranks) inherit them. Those buffers must
be private copy-on-write memory: shared pages would let siblings overwrite each other's payloads
between a read and its checks.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

import ckstore

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

ROUNDS = 150


def _child(root: str, key: str, want: bytes, conn: object) -> None:
    torch.set_num_threads(1)  # the parent's intra-op pool does not exist after fork
    try:
        with ckstore.open(root, create=True) as store:
            snap = store.get(key)
            for _ in range(ROUNDS):
                got = snap.read_object("m/w")  # under the inline threshold: the main thread reads
                assert got.numpy().tobytes() == want
                dest = {"m": ckstore.StateDict(w=torch.zeros(64, 64))}
                snap.restore(dest, memory_budget=0)  # atomic, past the budget: the digest path
                assert dest["m"]["w"].numpy().tobytes() == want
        conn.send("ok")  # type: ignore[attr-defined]
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(f"{type(exc).__name__}: {exc}")  # type: ignore[attr-defined]
    finally:
        os._exit(0)


def test_forked_children_reading_at_once_never_see_each_others_bytes(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    states = {f"r{i}": torch.randn(64, 64, generator=g) for i in range(3)}
    with ckstore.open(tmp_path / "s", chunk_bytes=4096, create=True) as store:
        for run, w in states.items():
            store.take({"m": ckstore.StateDict(w=w)}, run=run)
        assert torch.equal(
            store.get("r0").read_object("m/w"), states["r0"]
        )  # the parent's buffers exist now
        ctx = multiprocessing.get_context("fork")
        pipes, procs = [], []
        for run, w in states.items():
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child, args=(str(tmp_path / "s"), run, w.numpy().tobytes(), send)
            )
            p.start()
            pipes.append(recv)
            procs.append(p)
        results = []
        for recv, p in zip(pipes, procs):
            results.append(recv.recv() if recv.poll(120) else "no answer within 120 s")
            p.join(10)
            if p.is_alive():
                p.kill()
        assert results == ["ok"] * len(states)
