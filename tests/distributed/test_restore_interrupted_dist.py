"""A distributed atomic restore interrupted (Ctrl-C) while the ranks put their checked chunks
in place leaves each rank's destination whole, as a single-process one does
(``engine/restore/phases.py``, ``apply``): the read-once path put them in place itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from tests.distributed import interrupt_scenarios as isc
from tests.distributed import restore_scenarios as rs
from tests.support.ranks import run_ranks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


@pytest.mark.parametrize("budget", [None, 1 << 30], ids=["streamed", "held"])
def test_an_interrupted_distributed_restore_is_whole_on_every_rank(
    tmp_path: Path, budget: int | None
) -> None:
    path = str(tmp_path / "store")
    with ckstore.open(path, **rs.SMALL, create=True) as store:
        store.take({"s": rs.replicated_state()}, run="rep")
    res = run_ranks(isc.interrupted_restore, 2, tmp_path, path, budget)
    for rank, r in enumerate(res):
        assert r is not None and r["ok"], (rank, r)
        v = r["value"]
        assert v["restored"] == v["of"] or v["untouched"] == v["of"], (rank, v)
