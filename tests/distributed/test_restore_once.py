"""A distributed restore reads each chunk once, spread over the ranks, and never hangs.

Bytes are counted at the storage boundary (``objects.CountingBackend``: the pack bytes each
rank's backend returned). Real gloo ranks, forked on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from tests.distributed import restore_scenarios as rs
from tests.distributed import scenarios as sc
from tests.support.ranks import run_ranks, values

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("once")
    path = str(tmp / "store")
    with ckstore.open(path, **rs.SMALL, create=True) as store:
        snap = store.take({"s": rs.replicated_state()}, run="rep")
        ids = snap.manifest.chunk_ids()
        stored = sum(c.length for c in store.repository.index.all_chunks() if c.chunk_id in ids)
    return {"path": path, "stored": stored, "tmp": tmp}


def test_each_chunk_read_once_spread_over_the_ranks(replicated: dict[str, Any]) -> None:
    res = values(run_ranks(rs.counted_restores, 4, replicated["tmp"], replicated["path"]))
    stored = replicated["stored"]
    for mode in res[0]:
        per = [r[mode] for r in res]
        print(f"{mode}: {sum(per) / stored:.3f} x the stored bytes; per rank {per}")
    assert sum(r["each"] for r in res) >= 4 * stored  # every rank read everything itself
    for mode in ("once, atomic=False", "once, atomic, held", "once, atomic"):
        per = [r[mode] for r in res]
        mean = sum(per) / len(per)
        # streamed ("once, atomic", past the exchange budget) too: a reader keeps the views it
        # checked and sends them in the broadcast without reading them again
        assert stored <= sum(per) <= 1.0 * stored, (mode, per, stored)
        assert all(abs(x - mean) <= 0.10 * mean for x in per), (mode, per)


def test_resharded_restore_reads_each_chunk_once(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ckstore.open(path, **sc.TINY, create=True).close()
    res = values(run_ranks(rs.resharded_restore, 4, tmp_path, path))
    with ckstore.open(path) as store:  # the manifest's parts are chunks too, each read once
        ids = store.get("dt").manifest.referenced_ids()
        stored = sum(c.length for c in store.repository.index.all_chunks() if c.chunk_id in ids)
    print("resharded, read per rank:", [r["read"] for r in res], "stored", stored)
    assert sum(r["read"] for r in res) <= stored


def test_progress_lines_name_the_slowest_rank(replicated: dict[str, Any]) -> None:
    res = values(run_ranks(rs.logged_restore, 4, replicated["tmp"], replicated["path"]))
    lines = res[0]["lines"]
    print("\n".join(lines))
    assert lines and any("slowest rank 3" in x for x in lines), lines
    assert all(not r["lines"] for r in res[1:])  # rank 0 alone logs


@pytest.mark.parametrize(
    ("how", "where"), [("stop", "read"), ("kill", "read"), ("kill", "broadcast")]
)
def test_rank_lost_mid_restore_is_named_with_its_phase(
    replicated: dict[str, Any], how: str, where: str
) -> None:
    timeout = 5.0
    res = run_ranks(
        rs.stopped_restore,
        4,
        replicated["tmp"],
        replicated["path"],
        how,
        where,
        timeout,
        timeout=90,
        silent=1,
    )
    assert res[2] is None  # stopped or killed
    for r in (0, 1, 3):
        v = values([res[r]])[0]
        assert v["error"] and v["ranks"] == [2], v
        assert (
            "rank(s) [2] stopped responding" in v["error"]
            and f"last in phase {where!r}" in v["error"]
        ), v["error"]
        assert v["seconds"] < timeout + 10, v
        if where == "read":  # before the end of the read phase nothing is applied anywhere
            assert v["untouched"], v
        print(f"{how} in {where}: rank {r} raised after {v['seconds']:.1f} s: {v['error'][:160]}")


def test_a_job_reads_each_metadata_object_once(tmp_path: Path) -> None:
    """Four ranks restore a sharded snapshot (stored in parts) from fresh handles: the root is
    read once in the job (by rank 0) and each part at most once, nothing is listed, and each
    rank's view is enough to restore bit for bit, into the take's placements or others."""
    path = str(tmp_path / "store")
    ckstore.open(path, **sc.TINY, create=True).close()
    res = values(run_ranks(rs.metadata_reads, 4, tmp_path, path))
    with ckstore.open(path) as store:
        snap = store.get("meta")
        parts = set(snap.manifest.parts)
        rows = store.repository.index.chunk_locations(parts)
        where = {
            (f"packs/{r.pack_id[:2]}/{r.pack_id}.pack", r.offset): cid for cid, r in rows.items()
        }
    assert len(parts) == 4  # one part per rank, no nodes
    for case in ("same", "other"):
        got = [r[case] for r in res]
        print(case, [(g["manifest_gets"], len(g["pack_gets"]), g["lists"]) for g in got])
        assert [g["manifest_gets"] for g in got] == [1, 0, 0, 0], case
        assert all(g["lists"] == 0 for g in got), case
        read = [where[(n, o)] for g in got for n, o, _ in g["pack_gets"] if (n, o) in where]
        assert len(read) == len(set(read)), (case, read)  # each part once in the job
        if case == "same":  # each rank needs only its own part: read it itself
            assert len(read) == 4, read
