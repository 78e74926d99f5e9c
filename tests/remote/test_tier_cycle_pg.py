"""Review: on PostgreSQL an eviction switch and a compaction switch side by side close a delta
cycle that neither sees (the switch's _leads_back reads the chain without locking it)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine.lease import Lease
from ckstore.index import compaction as compaction_mod
from ckstore.index import tiering
from ckstore.index.records import ChunkRecord, PackRecord

KN = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _t(seed: int) -> torch.Tensor:
    return torch.randn(256, generator=torch.Generator().manual_seed(seed))


def _near(t: torch.Tensor, k: int) -> torch.Tensor:
    u = t.clone()
    u[k::37] += 1e-3
    return u


def test_eviction_and_compaction_side_by_side_close_a_delta_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg: Any
) -> None:
    index_url = pg.new_database()
    w = _t(1)
    a = _near(w, 0)
    x = _near(a, 1)
    b = _t(2)
    with ckstore.open(
        tmp_path / "local", index=index_url, create=True, auto_compact=False, delta_depth=4, **KN
    ) as store:
        store.add_remote("tier", str(tmp_path / "remote"))  # a tier remote (another producer)
        for step, t in enumerate([w, a, x], start=1):
            store.take({"m": ckstore.StateDict({"w": t})}, run="r", step=step, delta_base="parent")
        store.take({"m": ckstore.StateDict({"w": b})}, run="q", step=1)
        idx = store.repository.index
        rows = {c.chunk_id: c for c in idx.all_chunks()}
        ids = {}
        for c in rows.values():
            ids.setdefault(c.depth, []).append(c)
        (A,) = ids[1]  # a: delta against w
        (X,) = ids[2]  # x: delta against a
        (B,) = [c for c in ids[0] if c.chunk_id != A.base_id]  # b: whole, unrelated
        assert X.base_id == A.chunk_id

        # the eviction's switch: the remote stores a as a delta against b (depth 1 there too,
        # so the switch does not walk a's dependents)
        remote_a = ChunkRecord(
            A.chunk_id, "f" * 64, 0, A.length, A.raw_length, A.codec, B.chunk_id, 1, None
        )
        # the compaction's switch: b becomes a delta against x (its chain: x -> a -> w)
        dense = "e" * 64
        compact_b = ChunkRecord(
            B.chunk_id, dense, 0, B.length, B.raw_length, B.codec, X.chunk_id, 3, None
        )

        checked, decided = threading.Event(), threading.Event()
        real_leads_back, real_depth = tiering._leads_back, compaction_mod._delta_depth

        def leads_back(conn, base_id, chunk_id):
            found = real_leads_back(conn, base_id, chunk_id)
            checked.set()  # b's chain as read: whole, so no cycle...
            decided.wait(5)  # ...while the compaction decides b's switch (if it can)
            return found

        def delta_depth(conn, new, session_id):
            got = real_depth(conn, new, session_id)
            decided.set()  # no delta stored against b yet: the eviction has not written a's row
            return got

        monkeypatch.setattr(tiering, "_leads_back", leads_back)
        monkeypatch.setattr(compaction_mod, "_delta_depth", delta_depth)
        out: list[Any] = []

        def evict() -> None:
            try:
                out.append(idx.point_chunks_at_remote("tier", [remote_a], {A.chunk_id: A.pack_id}))
            except BaseException as exc:  # noqa: BLE001
                out.append(exc)

        e = threading.Thread(target=evict)
        e.start()
        assert checked.wait(30)
        with ckstore.open(tmp_path / "local", index=index_url) as other:
            oidx = other.repository.index
            with Lease(oidx, 60) as lease:
                oidx.rewrite_chunks(
                    lease.id, PackRecord(dense, B.length, 1, 0.0), [(compact_b, B.pack_id)]
                )
                oidx.end_session(lease.id, "committed")
                lease.committed = True
        e.join(30)
        assert not any(isinstance(o, BaseException) for o in out), out
        rows = {c.chunk_id: c for c in idx.all_chunks()}
        at, seen = rows[A.chunk_id], []
        while at.base_id is not None and at.chunk_id not in seen:
            seen.append(at.chunk_id)
            at = rows[at.base_id]
        assert at.base_id is None, f"a delta cycle: {[s[:8] for s in seen]} -> {at.chunk_id[:8]}"
