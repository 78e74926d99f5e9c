"""Replicas that disagree are named at take (issue 34, item 1), on 4 real ranks (gloo, fork).

A DDP job's parameters and a tensor a ``replicated=`` glob names are stored once, each block
by one rank; every rank's copy is compared by fingerprint. 50 single-bit flips, each in one
rank's copy of one tensor: every one is flagged with its rank, its key and the region that
holds it, recorded in the snapshot (``run@healthy`` skips it), and warned about; with
``on_divergence="raise"`` nothing is committed. 50 saves of a DDP job training
deterministically (each rank's own batches, so its batch norm statistics and RNG state are
its own): no alarm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed import replica_scenarios as rs
from tests.support.ranks import run_ranks, values

WORLD = 4


def _holds(region: list[list[int]], where: list[int]) -> bool:
    (offsets, sizes) = region
    return all(o <= w < o + s for o, s, w in zip(offsets, sizes, where))


def _flagged_alone(f: dict[str, Any]) -> None:
    """One flip, as the committing rank recorded it: that key alone, diverged and unhealthy,
    that rank alone, and one region, holding the flipped element."""
    assert f["diverged"] == 1 and f["healthy"] is False, f
    assert list(f["recorded"]) == [f["key"]], f
    got = f["recorded"][f["key"]]
    assert got["ranks"] == [f["rank"]], f
    assert len(got["regions"]) == 1 and _holds(got["regions"][0], f["where"]), f


def test_every_flipped_bit_is_flagged_with_its_rank_key_and_region(tmp_path: Path) -> None:
    out = values(run_ranks(rs.flips, WORLD, tmp_path, str(tmp_path / "store"), timeout=900))
    r0 = out[0]
    assert len(r0["found"]) == rs.FLIPS
    assert {f["key"] for f in r0["found"]} >= {"extra/table", "ddp/module.0.weight"}
    assert len({f["rank"] for f in r0["found"]}) == WORLD
    for f in r0["found"]:
        _flagged_alone(f)
        assert f["checked"] == 7  # 6 DDP parameters (not the batch norm's buffers), the table
    for rank in range(1, WORLD):  # every rank gets the committed record
        assert [f["diverged"] for f in out[rank]["found"]] == [1] * rs.FLIPS
    assert len(r0["warnings"]) == rs.FLIPS
    assert all("differ between ranks" in w and "@healthy" in w for w in r0["warnings"])
    assert all(o["warnings"] == [] for o in out[1:])  # the committing rank warns
    for o in out:  # refused: nothing committed, every rank names the cause
        assert o["refused"] is not None and o["steps"][0] == rs.FLIPS - 1
        assert o["healthy"]  # no snapshot of the run is healthy
    causes = " ".join(out[1]["refused"]["causes"].values())
    assert "ReplicaDivergenceError" in causes and "rank(s) [1]" in causes
    assert "ddp/module.0.weight" in causes


def test_deterministic_saves_raise_no_alarm(tmp_path: Path) -> None:
    out = values(run_ranks(rs.saves, WORLD, tmp_path, str(tmp_path / "store"), timeout=900))
    for o in out:
        assert o["diverged"] == [0] * rs.SAVES
        assert o["warnings"] == []
        assert o["healthy"] == list(reversed(range(rs.SAVES)))


def test_shards_held_by_several_ranks_are_compared_too(tmp_path: Path) -> None:
    """HSDP's replicated shards and a ``Replicate`` DTensor: every flipped bit is flagged with
    its rank, its key and the piece that holds it; an untouched state raises no alarm; with two
    copies the lower rank's is taken for right; ``on_divergence="raise"`` commits nothing."""
    out = values(run_ranks(rs.shard_flips, WORLD, tmp_path, str(tmp_path / "store"), timeout=900))
    r0 = out[0]
    assert r0["clean"]["diverged"] == 0 and r0["clean"]["warned"] == []
    assert r0["clean"]["checked"] == 2  # both DTensors: their shards are held by several ranks
    assert len(r0["found"]) == rs.SHARD_FLIPS
    assert {f["rank"] for f in r0["found"] if f["key"] == "m/rep"} == {0, 1, 2, 3}
    for f in r0["found"]:
        _flagged_alone(f)
        assert len(f["warned"]) == 1 and f["key"] in f["warned"][0], f
    for o in out[1:]:
        assert [f["diverged"] for f in o["found"]] == [1] * rs.SHARD_FLIPS
        assert all(f["warned"] == [] for f in o["found"])  # the committing rank warns
    swapped = r0["swapped"]["recorded"]
    assert r0["swapped"]["diverged"] == 1 and swapped["m/hsdp"]["ranks"] == [2, 3], swapped
    assert len(swapped["m/hsdp"]["regions"]) == 4  # every piece of both boxes (2 each)
    assert r0["tie"]["recorded"]["m/hsdp"]["ranks"] == [2]  # rank 0 flipped; 0 vs 2: 0 is kept
    for o in out:
        assert o["refused"] is not None
        assert o["steps"][0] == rs.SHARD_FLIPS + 2  # the refused take committed nothing
    causes = " ".join(out[1]["refused"]["causes"].values())
    assert "ReplicaDivergenceError" in causes and "m/hsdp" in causes
