"""TorchSnapshot's distributed surface on real gloo ranks (fork), and no hang, ever.

A take on a sub-group while the other rank waits in a barrier; a rank that never arrives is
named within the timeout plus a few seconds; RNGState order on every rank; a 2 -> 3 rank
elastic restore with per-rank values and RNG state (strict=False skips, strict raises);
``replicated=`` on async_take; rank-prefixed logical paths of a distributed snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it, ~3 s each otherwise)
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

import ckstore
from tests.distributed import compat_scenarios as cs
from tests.support.ranks import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def test_subgroup_take_beside_a_rank_in_a_barrier(tmp_path: Path) -> None:
    res = values(run_ranks(cs.subgroup, 3, tmp_path, str(tmp_path), 20.0, timeout=120))
    r0, r1, r2 = res
    assert r0["world_size"] == 2 and r0["async_id"] == r1["async_id"]
    assert r0["read"] == r1["read"] == [1, 0]  # "1/local/n" is rank 1's value on every rank
    assert "0/local/n" in r0["manifest"] and "1/local/n" in r0["manifest"]
    assert "1/ddp/module.0.weight" not in r0["manifest"]  # replicated: listed once, under rank 0
    assert all(r["model_ok"] for r in res) and all(r["optim_lr"] == 0.01 for r in res)
    assert r0["local"] == [0, 0.0] and r1["local"] == [1, 1.0]
    assert r2["local"] == [-1, 0.0]  # not in the take: its per-rank values stay as they were
    assert (
        r0["sd"] == {"mine": 0.0, "n": 0} and r1["sd"] == {"mine": 1.0, "n": 1} and r2["sd"] == {}
    )
    assert r0["sub_restore"] == 0 and r1["sub_restore"] == 1
    assert r2["barrier_at"] < 60  # released by the takers, not by a timeout


def test_rank_that_never_arrives_is_named_within_the_timeout(tmp_path: Path) -> None:
    timeout = 2.0
    res = values(run_ranks(cs.absent, 3, tmp_path, str(tmp_path / "s"), timeout, timeout=90))
    for r in res[:2]:
        first, later = r["open"], r["collective"]
        assert first["ranks"] == [2] and first["timeout_error"], first
        assert "rank(s) [2] never arrived" in first["error"], first["error"]
        assert (
            later["ranks"] == [2]
            and "rank(s) [2] never reached opening the store (alive" in later["error"]
        ), later
        for x in (first, later):  # named within the timeout plus a few seconds
            assert timeout - 0.5 <= x["seconds"] < timeout + 5, x
    assert all(
        res[2][p]["waited"] < timeout + 15 for p in ("open", "collective")
    )  # the barrier let go


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("elastic")
    for name in ("rep", "mixed"):  # small chunks, so a 16 KiB tensor spans several
        ckstore.open(tmp / name, chunk_bytes=1024, inline_bytes=64, create=True).close()
    took = values(run_ranks(cs.rng_elastic_take, 2, tmp, str(tmp)))
    restored = values(
        run_ranks(cs.rng_elastic_restore, 3, tmp, str(tmp), [t["after_take"] for t in took])
    )
    return {"took": took, "restored": restored}


def test_rng_state_order_on_every_rank(elastic: dict[str, Any]) -> None:
    took = elastic["took"]
    assert all(t["same"] for t in took)  # draws after restore == draws after take, per rank
    assert (
        took[0]["after_take"] != took[1]["after_take"]
    )  # the ranks' streams differ: per-rank entries


def test_distributed_logical_paths(elastic: dict[str, Any]) -> None:
    took = elastic["took"]
    assert took[0]["manifest"] == [
        "0/fx/n",
        "0/g/w",
        "0/local/mine",
        "0/local/n",
        "1/local/mine",
        "1/local/n",
    ]
    assert [t["read"] for t in took] == [0, 1]


def test_elastic_restore_two_to_three_ranks(elastic: dict[str, Any]) -> None:
    res = elastic["restored"]
    for r in res:  # strict: every rank raises, naming rank 2, and nothing is loaded anywhere
        assert (
            r["strict_error"]
            and "rank(s) [2]" in r["strict_error"]
            and "per rank" in r["strict_error"]
        )
        assert r["untouched_after_strict"]
        assert r["dtensor_ok"]  # the sharded tensor reshards onto 3 ranks either way
    assert [r["local"] for r in res] == [[0, 0.0], [1, 1.0], [-1, 0.0]]
    assert [r["rng_loads"] for r in res] == [1, 1, 0]  # rank 2 has no RNG state to load
    assert res[0]["draws_match"] and res[1]["draws_match"]
    assert not res[0]["warnings"] and not res[1]["warnings"]
    skipped = " ".join(res[2]["warnings"])
    assert "local/mine" in skipped and "rng/torch" in skipped and "strict=False" in skipped
    assert [r["sd"] for r in res] == [["mine", "n"], ["mine", "n"], []]
    assert [r["sd_rank0"] for r in res] == [0, 0, 0]


def test_replicated_globs_on_async_take(elastic: dict[str, Any]) -> None:
    rep = elastic["took"][0]["rep_hashed"]
    total = 64 * 64 * 4
    assert sum(rep) == total and all(h < total for h in rep)  # each rank hashed its share only
    kind, hashed = elastic["took"][0]["mixed"]
    assert kind == "tensor" and hashed == [
        total,
        total,
    ]  # globs differing by rank: per rank, stored once
