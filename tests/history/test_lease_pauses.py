"""Leases beside a writer that stops inside an index transaction (SIGSTOP, a suspended laptop,
a job frozen by its scheduler) while a gc runs in another process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
import ckstore.history.gc as gc_module
from tests.support.gc_workers import state_for
from tests.support.paths import REPO
from tests.support.procs import wait_stopped


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("where", ["commit", "add-pack", "compaction"])
def test_a_write_stalled_past_its_lease_loses_no_object_to_a_gcs_orphan_sweep(
    tmp_path: Path,
    dialect: str,
    where: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A take's index transaction (its commit, or the recording of a pack) passes its lease
    check, then its process stops (SIGSTOP) inside that transaction for longer than the lease.
    A gc in another process reaches its orphan sweep meanwhile: what the transaction records
    is not in the index yet and the lease has run out by the clock, so the sweep deleted it.
    Before, the process resumed and recorded it anyway: ``commit``, a committed snapshot
    without its manifest; ``add-pack``, chunk rows in a deleted pack, which the next take of
    the same state deduplicated against and committed; ``compaction``, the chunks of three
    committed snapshots switched to the deleted dense pack, their loose packs then deleted
    (docs/RELIABILITY.md, I1 and I4).
    Either the write fails or its objects stay, and every snapshot reads back."""
    url = str(tmp_path / "store")
    index = "" if dialect == "sqlite" else request.getfixturevalue("pg").new_database()
    store = ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True)
    go = tmp_path / "go"
    env = dict(os.environ, CKSTORE_LEASE_SECONDS="1.0")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.lease_workers", "stall", where, url, index, str(go)],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    real = gc_module._delete_orphans

    def sweep_beside_a_stalled_commit(*args: Any, **kwargs: Any) -> None:
        go.touch()  # the take commits now, and stops inside its commit
        wait_stopped(child)
        time.sleep(1.5)  # its lease runs out while it is stopped
        errors: list[BaseException] = []

        def sweep() -> None:
            try:
                real(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        sweeper = threading.Thread(target=sweep, daemon=True)
        sweeper.start()
        sweeper.join(timeout=3.0)  # done, or waiting for the stopped writer's transaction
        os.kill(child.pid, signal.SIGCONT)
        sweeper.join(timeout=60)
        assert not sweeper.is_alive(), "the sweep hangs after the writer resumed"
        if errors:
            raise errors[0]

    try:
        while not (tmp_path / "go.waiting").exists():
            assert child.poll() is None, child.communicate()
            time.sleep(0.02)
        monkeypatch.setattr(gc_module, "_delete_orphans", sweep_beside_a_stalled_commit)
        store.gc(grace_seconds=0)
        monkeypatch.setattr(gc_module, "_delete_orphans", real)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    assert child.returncode in (0, 3), (out, err)
    store.take({"s": ckstore.StateDict(state_for(1))}, run="again", step=1)  # a retry, say
    report = store.check(read_data=True)
    assert report.ok, (out, report.problems)
    for snap in store.log():  # whatever was committed reads back
        got = snap.read_object("s")
        assert all(torch.equal(got[k], v) for k, v in state_for(snap.step or 1).items())
    store.close()


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def test_a_writer_whose_clock_runs_behind_loses_no_pack_to_a_gcs_orphan_sweep(
    tmp_path: Path, dialect: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's host runs 2.5 s behind the gc's, with a lease of 3 s: each heartbeat leaves
    its lease 0.5 s by the gc's clock, 3 s by its own. The gc began while the lease was valid by
    its clock (no session expired); by its orphan sweep the lease had run out by its clock, so
    the sweep deleted the take's durable pack, not yet recorded; the writer, whose lease was
    valid by its own clock, recorded it and committed a snapshot whose pack was gone. The
    lease's end must be decided once, in the index, for both sides."""
    from ckstore.index.sessions import Sessions

    url = str(tmp_path / "store")
    index = "" if dialect == "sqlite" else request.getfixturevalue("pg").new_database()
    store = ckstore.open(url, index=index or None, chunk_bytes=1024, pack_bytes=4096, create=True)
    go = str(tmp_path / "go")
    env = dict(os.environ, CKSTORE_LEASE_SECONDS="3.0")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.lease_workers", "behind", url, index, "2.5", go],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def lease_left() -> float:  # by this (the gc's) clock
        held = store.repository.index.held_sessions()
        return max(h.session.expires_at for h in held) - time.time() if held else -1.0

    def wait_for(ok: Any) -> None:
        deadline = time.time() + 30
        while not ok():
            assert time.time() < deadline and child.poll() is None, child.communicate()
            time.sleep(0.01)

    real_expire, real_sweep = Sessions.expire_sessions, gc_module._delete_orphans

    began: list[bool] = []

    def expire_while_valid(self: Any, *args: Any, **kwargs: Any) -> int:
        if not began:  # the gc's first step: just after a heartbeat
            began.append(True)
            wait_for(lambda: lease_left() > 0.3)
        return real_expire(self, *args, **kwargs)

    def sweep_once_run_out(*args: Any, **kwargs: Any) -> None:
        wait_for(lambda: lease_left() < -0.05)  # before the next heartbeat
        try:
            real_sweep(*args, **kwargs)
        finally:
            Path(go).touch()

    try:
        wait_for(lambda: os.path.exists(go + ".waiting"))
        monkeypatch.setattr(Sessions, "expire_sessions", expire_while_valid)
        monkeypatch.setattr(gc_module, "_delete_orphans", sweep_once_run_out)
        store.gc(grace_seconds=0)
        monkeypatch.setattr(Sessions, "expire_sessions", real_expire)
        monkeypatch.setattr(gc_module, "_delete_orphans", real_sweep)
        out, err = child.communicate(timeout=60)
    finally:
        Path(go).touch()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode in (0, 3), (out, err)
    report = store.check(read_data=True)
    assert report.ok, (out, report.problems)
    for snap in store.log():
        got = snap.read_object("s")
        assert all(torch.equal(got[k], v) for k, v in state_for(1).items())
    store.close()
