"""Many hosts, one store: separate processes (each its own cwd and home) take, restore and gc
against one S3 bucket and one PostgreSQL index at the same time, one of them a 4-rank
torch.distributed job (gloo) taking sharded snapshots. On moto, and on SeaweedFS (a real S3
server writing to disk) with fewer steps, to keep the run short.

Afterwards every visible snapshot restores bit-exactly (the sharded ones into plain tensors in
this one process), ``check(read_data=True)`` is clean, no committed snapshot is missing unless
retention dropped it, and no take failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from tests.support.host_worker import state_for
from tests.support.paths import REPO

DIST_HOST, DIST_RUN, DIST_WORLD = "host-dist", "dist", 4  # one gloo job, 4 ranks
SERVERS = {
    "moto": ("s3_server", 5, 4),
    "seaweedfs": ("seaweed_server", 3, 3),
}  # fixture, steps per host, dist steps


def take_hosts(steps: int) -> dict[str, tuple[str, range]]:
    """host -> (run, steps): two hosts on runs of their own, two sharing one run."""
    return {
        "host-a": ("a", range(1, steps + 1)),
        "host-b": ("b", range(1, steps + 1)),
        "host-c": ("shared", range(1, 2 * steps + 1, 2)),
        "host-d": ("shared", range(2, 2 * steps + 1, 2)),
    }


def _spawn(tmp: Path, host: str, args: list[str]) -> subprocess.Popen[str]:
    home = tmp / host
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "TMPDIR": str(home),
        "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.host_worker", *args],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_many_hosts_one_bucket_one_index(
    tmp_path: Path, pg: Any, server: str, request: pytest.FixtureRequest
) -> None:
    fixture, steps, dist_steps = SERVERS[server]
    s3 = request.getfixturevalue(fixture)
    TAKERS, DIST_STEPS = take_hosts(steps), range(1, dist_steps + 1)  # noqa: N806 - the constants of one run
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(bucket)
    url, index, opts = f"s3://{bucket}/team", pg.new_database(), json.dumps(s3.storage_options())
    ckstore.open(
        url,
        index=index,
        storage_options=json.loads(opts),
        chunk_bytes=1024,
        pack_bytes=8192,
        create=True,
    ).close()
    started = time.time()
    procs = {
        h: _spawn(tmp_path, h, ["take", url, index, opts, run, ",".join(map(str, steps))])
        for h, (run, steps) in TAKERS.items()
    }
    procs[DIST_HOST] = _spawn(
        tmp_path,
        DIST_HOST,
        ["dist", url, index, opts, DIST_RUN, ",".join(map(str, DIST_STEPS)), str(DIST_WORLD)],
    )
    procs["host-gc"] = _spawn(tmp_path, "host-gc", ["gc", url, index, opts, "80"])
    outs = {}
    for host, p in procs.items():
        if host == "host-gc":
            (tmp_path / host / "stop").touch()  # every take has ended: one more gc run, then stop
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, f"{host} exited {p.returncode}: {err[-2000:]}"
        outs[host] = _lines(out)
    elapsed = time.time() - started

    takers = [*TAKERS, DIST_HOST]
    committed = {
        x["committed"]: (x["run"], x["step"]) for h in takers for x in outs[h] if "committed" in x
    }
    failed = [x for h in takers for x in outs[h] if "failed" in x]
    inexact = [x for h in takers for x in outs[h] if "committed" in x and not x["restored_exact"]]
    dist_ids = {x["committed"] for x in outs[DIST_HOST] if "committed" in x}
    dropped = {s for x in outs["host-gc"] for s in x["dropped"]}
    gc_runs = len(outs["host-gc"])

    store = ckstore.open(url, index=index, storage_options=json.loads(opts), create=True)
    try:
        visible = {s.id: s for s in store.log()}
        lost = {
            s
            for s, (run, step) in committed.items()
            if s not in visible and f"{run}@{step}" not in dropped
        }
        for sid, snap in visible.items():
            run, step = committed[sid]
            want = state_for(run, step)
            got = ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})
            snap.restore({"s": got})
            assert all(torch.equal(got[k], v) for k, v in want.items()), (
                f"{run}@{step} restored other bytes"
            )
        report = store.check(read_data=True)
        for run in ("a", "b", "shared", DIST_RUN):  # retention kept the newest of every run
            newest = max(step for r, step in committed.values() if r == run)
            assert store.get(f"{run}@{newest}").step == newest
        assert store.get(f"{DIST_RUN}@{max(DIST_STEPS)}").record.world_size == DIST_WORLD
    finally:
        store.close()
    dist_lost = lost & dist_ids
    dist_visible = dist_ids & set(visible)
    print(
        f"\nmany writers on {server}: {len(TAKERS)} take hosts + a {DIST_WORLD}-rank job ({len(dist_ids)} sharded takes committed, "
        f"{len(dist_visible)} visible, {len(dist_lost)} lost) + 1 gc host, {len(committed)} takes committed, "
        f"{len(failed)} failed, {len(lost)} lost, {len(dropped)} dropped by retention ({gc_runs} gc runs), "
        f"{len(visible)} visible and restored bit-exactly, check(read_data=True): {len(report.problems)} problems "
        f"({report.chunks_read} chunks read), {elapsed:.1f} s"
    )
    assert not failed and not inexact
    assert len(committed) == sum(len(s) for _, s in TAKERS.values()) + len(DIST_STEPS)
    assert len(dist_ids) == len(DIST_STEPS)
    assert not lost
    assert dropped, "the gc host dropped nothing: retention never ran beside the writers"
    assert report.ok, report.problems[:5]
    assert report.chunks_read > 0
