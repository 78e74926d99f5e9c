"""The guard on 2 real ranks (gloo, fork): every rank's shard is measured where it is hashed
and the figures meet on the rank that commits; staleness compares the assembled entries."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

from tests.distributed import guard_scenarios as gs
from tests.support.ranks import run_ranks, values


def test_sharded_stale_and_nonfinite_are_found(tmp_path: Path) -> None:
    out = values(run_ranks(gs.sharded_guard, 2, tmp_path, str(tmp_path / "store"), timeout=300))
    r0 = out[0]
    assert out[0]["records"] == out[1]["records"]  # every rank gets the committed record
    healthy, stale, bad = r0["records"]
    assert healthy == [0, 0]  # trained: nothing stale, nothing non-finite
    moments = {k for k in r0["stale_keys"] if k.startswith("optim/")}
    assert set(r0["stale_keys"]) - moments == set(r0["params"])  # every sharded parameter...
    assert len(moments) == 2 * len(r0["params"])  # ...and its exp_avg, exp_avg_sq
    assert stale == [len(r0["stale_keys"]), 0]
    assert bad[1] == 1 and r0["bad_keys"] == [r0["nan_in"]]  # the NaN on rank 1's shard
    assert r0["dcp_nonfinite"] == 1  # dcp.save: the same figures through DCP's protocol
    assert any(w.startswith("NaN/Inf in model/") for w in r0["warnings"])
    assert any("did not change since step 2" in w for w in r0["warnings"])
