"""Faults during a push, with real processes: SIGKILL at random points of a push (chosen from a
traced run: every kind of call at least once, then more at random), two pushes into one remote
at once, and gc on both sides while a push runs. After each: the destination shows no partial
snapshot (every snapshot there restores bit for bit), the source never records as pushed what
the remote lacks, the next push completes, and ``check(read_data=True)`` is clean on both sides.

``CKSTORE_PUSH_KILLS=N`` runs N kill points instead of the default 22 (150 with
``CKSTORE_SOAK=1``, as the take's crash tests); ``CKSTORE_SEED`` picks them.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.support.push_kills import push_in_child
from tests.support.remotes import KNOBS, fill, restores, same_history

POINTS = int(
    os.environ.get("CKSTORE_PUSH_KILLS", "150" if os.environ.get("CKSTORE_SOAK") else "22")
)
SEED = int(os.environ.get("CKSTORE_SEED", "26"))
STEPS = {"r": [1, 2, 3, 4, 5], "s": [10, 11]}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source store: run ``r`` (tag ``best`` at 2) and run ``s``, no remote yet."""
    path = tmp_path_factory.mktemp("push-kills") / "src"
    with ckstore.open(path, create=True, **KNOBS) as store:
        fill(store, "r", STEPS["r"], tags={2: ["best"]})
        fill(store, "s", STEPS["s"])
    return path


def _dest(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind == "local":
        return {"url": str(tmp_path / "remote"), "index": None, "storage_options": None}
    if kind == "moto+postgresql":
        server = request.getfixturevalue("s3_server")
        bucket = f"ck-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        return {
            "url": f"s3://{bucket}/remote",
            "index": request.getfixturevalue("pg").new_database(),
            "storage_options": server.remote_options(),
        }
    server = request.getfixturevalue("seaweed_server")
    # a remote's credentials come from the environment; SeaweedFS refuses a session token
    request.getfixturevalue("monkeypatch").delenv("AWS_SESSION_TOKEN", raising=False)
    if "ckfaults" not in server.buckets():
        server.create_bucket("ckfaults")
    return {
        "url": f"s3://ckfaults/{uuid.uuid4().hex[:12]}",
        "index": request.getfixturevalue("pg").new_database(),
        "storage_options": server.remote_options(),
    }


def _source(template: Path, where: Path, dest: dict[str, Any], seed_best: bool = True) -> Path:
    """A copy of the template with remote ``origin`` at ``dest`` (holding r@1 and ``best`` already)."""
    shutil.copytree(template, where)
    with ckstore.open(where) as store:
        store.add_remote(
            "origin", dest["url"], index=dest["index"], storage_options=dest["storage_options"]
        )
        if seed_best:
            store.push(
                "origin", ["r@1", "best"]
            )  # the remote exists and holds some chunks: negotiation skips them
    return where


def _open(dest: dict[str, Any]) -> ckstore.Store:
    return ckstore.open(dest["url"], index=dest["index"], storage_options=dest["storage_options"])


def _assert_no_partial(src_path: Path, dest: dict[str, Any]) -> None:
    """Every snapshot at the remote is whole; the source records nothing the remote lacks."""
    with _open(dest) as remote, ckstore.open(src_path) as src:
        there = {s.id: s for s in remote.log()}
        assert set(there) <= {s.id for s in src.log()}
        for snap in there.values():
            assert restores(remote, snap.id, snap.step), snap.ref
        recorded = {sid for sid, st in src.push_status().items() if "origin" in st.remotes}
        assert recorded <= set(there), (
            "the source records as pushed a snapshot the remote does not hold"
        )
        report = remote.check(read_data=True)
        assert report.ok, report.problems


def _assert_completes(src_path: Path, dest: dict[str, Any]) -> None:
    """The next push completes; both sides check clean, and the dead push's garbage goes."""
    with ckstore.open(src_path) as src, _open(dest) as remote:
        src.push("origin")
        assert same_history(src, remote)
        assert {s.state for s in src.push_status().values()} == {"pushed"}
        assert all(
            restores(remote, f"{run}@{step}", step)
            for run, steps in STEPS.items()
            for step in steps
        )
        assert remote.check(read_data=True).ok and src.check(read_data=True).ok
        remote.repository.index.expire_sessions(time.time() + 10 * remote.repository.lease_seconds)
        remote.gc(grace_seconds=0)
        after = remote.check(read_data=True)
        assert after.ok and after.orphan_packs == [] and after.orphan_manifests == [], after


def _points(events: list[str], count: int, rng: random.Random) -> list[tuple[int, str]]:
    """Kill points (event number from 1, before/after): each kind of event once, then at random."""
    first: dict[str, list[int]] = {}
    for i, e in enumerate(events, 1):
        first.setdefault(e, []).append(i)
    chosen = {(rng.choice(idx), rng.choice(("before", "after"))) for idx in first.values()}
    while len(chosen) < min(count, 2 * len(events)):
        chosen.add((rng.randint(1, len(events)), rng.choice(("before", "after"))))
    return sorted(chosen)


@pytest.mark.parametrize(
    "kind", ["local", pytest.param("moto+postgresql", marks=[pytest.mark.s3, pytest.mark.postgres])]
)
def test_a_push_killed_anywhere_leaves_no_partial_snapshot_and_the_next_completes(
    kind, template, tmp_path, request
) -> None:
    import json

    count = POINTS if kind == "local" else max(6, POINTS // 4)
    traced = _source(template, tmp_path / "traced", _dest(kind, tmp_path / "t", request))
    assert push_in_child(traced, trace=tmp_path / "trace.json") == 0
    events = json.loads((tmp_path / "trace.json").read_text())
    assert {
        "put packs",
        "put manifests",
        "index.add_pack",
        "index.commit_snapshot",
        "src.mark_pushed",
    } <= set(events)
    rng = random.Random(f"{SEED}-{kind}")
    points = _points(events, count, rng)
    assert len(points) >= min(count, 20 if kind == "local" else 6)
    for k, (at, when) in enumerate(points):
        where = tmp_path / f"p{k}"
        dest = _dest(kind, where, request)
        src = _source(template, where / "src", dest)
        code = push_in_child(src, kill_at=at, when=when)
        label = f"kill {when} event {at} ({events[at - 1]}) of {len(events)}, seed {SEED}"
        assert code == -9, f"{label}: the child exited {code} (the point was never reached)"
        try:
            _assert_no_partial(src, dest)
            _assert_completes(src, dest)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc
        shutil.rmtree(where, ignore_errors=True)


def _push_when(go: Any, src: str) -> None:
    """A child: wait for ``go``, push to ``origin``, exit 0 (or 1 with the error printed)."""
    try:
        go.wait(60)
        with ckstore.open(src) as store:
            store.push("origin")
    except BaseException as exc:  # noqa: BLE001 - reported through the exit code
        print(f"push of {src} failed: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize(
    "kind",
    ["local", pytest.param("seaweedfs+postgresql", marks=[pytest.mark.s3, pytest.mark.postgres])],
)
def test_two_pushes_into_one_remote_at_once(kind, template, tmp_path, request) -> None:
    dest = _dest(kind, tmp_path, request)
    a = _source(template, tmp_path / "a", dest, seed_best=False)
    b = _source(template, tmp_path / "b", dest, seed_best=False)
    with ckstore.open(b) as store:
        fill(store, "t", [20, 21])  # b has a run of its own, and shares r and s with a
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_push_when, args=(go, str(p))) for p in (a, b)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    with _open(dest) as remote, ckstore.open(b) as sb, ckstore.open(a) as sa:
        assert same_history(sb, remote)
        assert all(
            restores(remote, f"{run}@{step}", step)
            for run, steps in STEPS.items()
            for step in steps
        )
        assert restores(remote, "t@21", 21) and remote.check(read_data=True).ok
        assert sa.push("origin").stats.bytes_sent == 0 and sb.push("origin").stats.bytes_sent == 0


def test_gc_on_both_sides_during_a_push_loses_nothing(template, tmp_path, monkeypatch) -> None:
    dest = _dest("local", tmp_path, None)  # type: ignore[arg-type]
    src = _source(template, tmp_path / "src", dest)
    with ckstore.open(src) as store:
        fill(store, "r", [6, 7, 8])
        store.gc(
            keep_last=3, runs=["r"], grace_seconds=0
        )  # retention: this store's garbage to sweep below
    from ckstore.remote import copy

    real_put = copy._Sink._put  # slow the push down: gc runs between its packs

    def slow_put(self: Any, *a: Any, **k: Any) -> Any:
        time.sleep(0.05)
        return real_put(self, *a, **k)

    monkeypatch.setattr(copy._Sink, "_put", slow_put)
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    proc = ctx.Process(target=_push_when, args=(go, str(src)))
    proc.start()
    go.set()
    rounds = 0
    while proc.is_alive() or rounds < 2:
        with _open(dest) as remote:
            remote.gc(grace_seconds=0)  # sweeps anything unpinned and unreferenced at once
        with ckstore.open(src) as local:
            local.gc(grace_seconds=0)
        rounds += 1
    proc.join(60)
    assert proc.exitcode == 0 and rounds >= 2
    with ckstore.open(src) as local, _open(dest) as remote:
        assert {s.id for s in local.log()} <= {
            s.id for s in remote.log()
        }  # r@1 went before the source dropped it
        assert (
            remote.tags() == local.tags()
            and remote.check(read_data=True).ok
            and local.check(read_data=True).ok
        )
        for snap in remote.log():
            assert restores(remote, snap.id, snap.step), snap.ref
        assert {s.step for s in remote.log(run="r")} >= {6, 7, 8}
