"""A full disk (issue 27, item 14): the error says nothing was committed and that gc reclaims
what the take wrote; then gc does, and the store checks clean.

In-process, the local backend's writes fail with ENOSPC after a few packs; in a user
namespace, a real 2 MiB tmpfs fills up under a take and under ``ckstore import`` (skipped where
the kernel does not allow it).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ckstore
from ckstore.errors import NoSpaceError, StorageError
from ckstore.objects import local
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def test_enospc_says_nothing_was_committed_and_gc_reclaims(tmp_path, monkeypatch) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    torch.manual_seed(0)
    store.take({"m": ckstore.StateDict(w=torch.randn(8, 64))}, run="r", step=1, tags=["best"])
    real = local._write_all
    written = {"n": 0}

    def filling(fd: int, view) -> None:
        written["n"] += len(view)
        if written["n"] > 3 * TINY["pack_bytes"]:  # a few packs fit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view)

    monkeypatch.setattr(local, "_write_all", filling)
    with pytest.raises(NoSpaceError) as exc:
        store.take({"m": ckstore.StateDict(w=torch.randn(256, 64))}, run="r", step=2)
    message = str(exc.value)
    assert isinstance(exc.value, StorageError) and isinstance(exc.value, OSError)
    assert "No space left on device" in message and "nothing was committed" in message
    assert "ckstore gc" in message and "--grace 0s" in message
    monkeypatch.setattr(local, "_write_all", real)
    assert not list((tmp_path / "s").rglob(".writer-*"))  # the failed pack's staging file is gone
    assert [s.step for s in store.log()] == [1] and store.get("best").step == 1
    assert store.repository.index.held_sessions() == []  # the failed take ended its lease
    report = store.gc(grace_seconds=0)
    assert report.chunks_removed > 0 and report.bytes_reclaimed > 0
    assert store.check(read_data=True).ok
    store.close()


SCRIPT = r"""
import os, sys, torch, ckstore
from ckstore import cli
from safetensors.torch import save_file
full, outside = sys.argv[1], sys.argv[2]
big = os.path.join(outside, "big.safetensors")
index = "sqlite:///" + os.path.join(outside, "index.sqlite")  # the packs fill the disk, not the index
torch.manual_seed(0)
save_file({"w": torch.randn(1024, 1024)}, big)  # 4 MiB of incompressible floats
store = ckstore.open(os.path.join(full, "s"), index=index, create=True, chunk_bytes=1 << 16, pack_bytes=1 << 18)
store.take({"m": ckstore.StateDict(w=torch.zeros(8))}, run="r", step=1)
try:
    store.take({"m": ckstore.StateDict(w=torch.randn(1024, 1024))}, run="r", step=2)
except ckstore.errors.NoSpaceError as exc:
    print("TAKE", type(exc).__name__, "nothing was committed" in str(exc))
print("LOG", [s.step for s in store.log()])
print("GC", store.gc(grace_seconds=0).bytes_reclaimed > 0, store.check(read_data=True).ok)
store.close()
print("IMPORT", cli.main(["--store", os.path.join(full, "s"), "--index", index, "import", big, "--run", "imp"]))
"""


def test_a_real_full_disk(tmp_path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare")
    full, outside = tmp_path / "full", tmp_path / "outside"
    full.mkdir()
    outside.mkdir()
    probe = subprocess.run(
        [unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {full}"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip("no user namespaces with tmpfs mounts here")
    env = {k: v for k, v in os.environ.items() if k != "CKSTORE_STORE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [unshare, "-rm", "sh", "-c", 'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$1" -c "$2" "$0" "$3"',
         str(full), sys.executable, SCRIPT, str(outside)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TAKE NoSpaceError True" in done.stdout, done.stdout + done.stderr
    assert "LOG [1]" in done.stdout and "GC True True" in done.stdout
    assert "IMPORT 6" in done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckstore: error:")]
    assert len(lines) == 1 and "no space left" in lines[0] and "nothing was committed" in lines[0]
    assert "Traceback" not in done.stderr


def test_a_full_index_disk_is_the_same_error() -> None:
    import sqlite3

    from ckstore.index._errors import translated

    with pytest.raises(NoSpaceError, match="nothing was committed") as exc:
        with translated("commit snapshot x", "sqlite:////full/index.sqlite"):
            raise sqlite3.OperationalError("database or disk is full")
    assert "ckstore gc" in str(exc.value)
