"""Write sessions killed mid-take (issue 27, item 8): SIGTERM ends the lease as Ctrl-C does, and
``du`` and ``gc`` say which sessions still hold data, whose, and until when.

The children block inside the commit (every pack written; all but the last, which the commit's
own transaction records, indexed and pinned) and are then sent SIGTERM or SIGKILL: the first
exits 143 with its lease ended, the second leaves a session that ``du`` and ``gc`` name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.engine import lease as lease_mod
from tests.support.paths import REPO

CHILD = """
import sys, time, torch, ckstore
from ckstore.index import Index
real = Index.commit_snapshot
def slow_commit(self, *args, **kwargs):
    print("IN TAKE", flush=True)
    time.sleep(60)
    return real(self, *args, **kwargs)
Index.commit_snapshot = slow_commit
store = ckstore.open(sys.argv[1], chunk_bytes=1024, pack_bytes=8192, inline_bytes=64)
torch.manual_seed(0)
# 60 chunks of 1 KiB: the last pack is never full, stored raw or compressed
store.take({"m": ckstore.StateDict(w=torch.randn(60, 256))}, run="r", step=2)
print("COMMITTED", flush=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _interrupted_take(path: Path, sig: int) -> subprocess.CompletedProcess[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "IN TAKE", line + child.stderr.read() if child.stderr else line
    child.send_signal(sig)
    out, err = child.communicate(timeout=60)
    return subprocess.CompletedProcess(child.args, child.returncode, line + out, err)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with ckstore.open(
        path, create=True, chunk_bytes=1024, pack_bytes=8192, inline_bytes=64
    ) as store:
        store.take({"m": ckstore.StateDict(w=torch.zeros(4))}, run="r", step=1)
    return path


def test_sigterm_mid_take_releases_the_lease(store_path, capsys) -> None:
    done = _interrupted_take(store_path, signal.SIGTERM)
    assert done.returncode == 143, (done.returncode, done.stdout, done.stderr)
    assert "COMMITTED" not in done.stdout and "Traceback" not in done.stderr
    with ckstore.open(store_path) as store:
        assert store.repository.index.held_sessions() == []  # ended as aborted: nothing held
        assert [s.step for s in store.log()] == [1]
        report = store.gc(grace_seconds=0)
        assert (
            report.chunks_removed > 0 and report.orphans_removed == 2
        )  # at once; orphans: the last pack, the manifest
        assert report.sessions_held == []
    assert cli.main(["--store", str(store_path), "du"]) == 0
    assert "write sessions" not in capsys.readouterr().out


def test_a_killed_take_is_named_by_du_and_gc(store_path, capsys) -> None:
    done = _interrupted_take(store_path, signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    with ckstore.open(store_path) as store:
        (held,) = store.repository.index.held_sessions()
        assert held.pinned_chunks > 0 and held.held_bytes > 0
        host, pid, _ = _parts(held.session.owner)
        assert host and pid.isdigit()  # host:pid of the killed take
    s = ("--store", str(store_path))
    assert cli.main(["du", *s]) == 0
    out = capsys.readouterr().out
    assert "write sessions holding data (1)" in out and held.session.owner in out
    assert "lease until" in out and "chunks pinned" in out
    assert cli.main(["du", "--json", *s]) == 0
    (session,) = json.loads(capsys.readouterr().out)["sessions"]
    assert session["owner"] == held.session.owner and session["held_bytes"] == held.held_bytes
    assert session["expires_at"] > time.time() and session["expired"] is False
    assert cli.main(["gc", "--dry-run", "--json", *s]) == 0
    assert json.loads(capsys.readouterr().out)["sessions_held"][0]["owner"] == held.session.owner
    with ckstore.open(store_path) as store:  # a session held for a take elsewhere (another host)
        other = store.repository.index.begin_session("elsewhere:4242", 600)
    assert cli.main(["gc", "--grace", "0s", *s]) == 0
    out = capsys.readouterr().out
    assert "gc leaves those bytes" in out and "elsewhere:4242" in out
    with ckstore.open(store_path) as store:
        store.repository.index.end_session(other.id, "aborted")


def _parts(owner: str) -> tuple[str, str, str]:
    """``host``, ``pid`` and the rest of a session owner ``host:pid (...)``."""
    head, _, where = owner.partition(" ")
    host, _, pid = head.rpartition(":")
    return host, pid, where


def test_gc_expires_the_sessions_of_dead_processes_of_its_own_host(store_path) -> None:
    """Before: a killed take's session held its bytes, and blocked orphan cleanup, until its
    lease ran out (10 minutes), although gc runs on the host where that process is gone."""
    done = _interrupted_take(store_path, signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    with ckstore.open(store_path) as store:
        index = store.repository.index
        (dead,) = index.held_sessions()
        host, pid, where = _parts(dead.session.owner)
        assert host == socket.gethostname() and where  # where the pid means something
        alive = index.begin_session(lease_mod.owner(), 600)  # this process
        unknown = index.begin_session(f"{host}:{pid}", 600)  # no namespace said: cannot tell
        elsewhere = index.begin_session(f"other-host:{pid} {where}", 600)
        report = store.gc(grace_seconds=0)
        assert report.sessions_expired == 1
        assert {h["owner"] for h in report.sessions_held} == {
            alive.owner,
            unknown.owner,
            elsewhere.owner,
        }
        assert report.chunks_removed > 0 and report.orphans_removed == 0  # others still live
        for s in (alive, unknown, elsewhere):
            index.end_session(s.id, "aborted")
        assert store.gc(grace_seconds=0).orphans_removed == 2  # the last pack, the manifest
        assert [s.step for s in store.log()] == [1]


ABANDONED = """
import sys, threading, time, torch, ckstore
from ckstore.history import compact
inside = threading.Event()
real = compact.resolve_bases
def slow(*args, **kwargs):
    inside.set()
    time.sleep(60)
    return real(*args, **kwargs)
compact.resolve_bases = slow
store = ckstore.open(sys.argv[1], auto_compact=True)  # keeps each run's newest loose
for step in (2, 3, 4):
    torch.manual_seed(step)
    store.take({"m": ckstore.StateDict(w=torch.randn(64, 256))}, run="r", step=step)
assert inside.wait(60), "no background compaction started"
print("IN COMPACTION", flush=True)
# no store.close(): the interpreter exits with the background compaction in its session
"""


def test_a_process_that_exits_without_close_ends_its_sessions(store_path) -> None:
    """Before: the background compaction's session stayed active for its whole lease (10
    minutes) after the process was gone, reported as a take in progress or killed."""
    child = subprocess.run(
        [sys.executable, "-c", ABANDONED, str(store_path)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr
    assert "IN COMPACTION" in child.stdout
    assert "Traceback" not in child.stderr, child.stderr
    with ckstore.open(store_path) as store:
        assert store.repository.index.held_sessions() == []
        assert store.repository.index.live_sessions() == []
        assert [s.step for s in store.log()] == [4, 3, 2, 1]
        report = store.gc(grace_seconds=0)
        assert report.sessions_held == [] and report.sessions_expired == 0
        assert store.check(read_data=True).ok


def test_the_handler_is_ckstores_only_during_a_take_and_never_replaces_the_programs(
    tmp_path,
) -> None:
    seen = []
    real = ckstore.index.Index.commit_snapshot

    def spy(self, *args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        return real(self, *args, **kwargs)

    state = {"m": ckstore.StateDict(w=torch.ones(4))}
    with ckstore.open(tmp_path / "s", create=True) as store:
        ckstore.index.Index.commit_snapshot = spy
        try:
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            store.take(state, run="r", step=1)
            assert seen[-1] is lease_mod._on_sigterm
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back afterwards

            def mine(signum, frame):  # the program's own handler
                pass

            previous = signal.signal(signal.SIGTERM, mine)
            try:
                store.take(state, run="r", step=2)
                assert seen[-1] is mine and signal.getsignal(signal.SIGTERM) is mine
            finally:
                signal.signal(signal.SIGTERM, previous)
        finally:
            ckstore.index.Index.commit_snapshot = real


def test_a_sigterm_after_the_last_lease_ended_elsewhere_is_the_default_action(tmp_path) -> None:
    """An async take ends its lease in its own thread, which cannot put SIGTERM's default back:
    the handler then behaves as the default action (the process ends, no exit code 143)."""
    script = (
        "import os, signal, time, torch, ckstore\n"
        f"store = ckstore.open({str(tmp_path / 's')!r}, create=True)\n"
        "store.async_take({'m': ckstore.StateDict(w=torch.ones(4))}, run='r', step=1).wait()\n"
        "time.sleep(1)  # wait() returns just before the background thread ends the lease\n"
        "print('HANDLER', signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "print('SURVIVED')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "SURVIVED" not in done.stdout and "Traceback" not in done.stderr
