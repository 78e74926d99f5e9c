"""The command line's read commands run without torch, and print quickly.

Each command runs in a fresh interpreter whose import system refuses ``torch`` (a meta-path
finder placed first raises ImportError for it and its submodules), so any import of torch on
the way, lazy or not, fails the command. Then the commands are timed against the half-second
budget. Wall time on a shared machine mostly measures the neighbours, so the test measures the
command's CPU time (user + system; on an idle core that is its wall time), best of five, with
bytecode caching on as in an installed package. The budget holds where
``python -c "import sqlalchemy"`` (the index library every command needs) costs 0.3 s of CPU,
as on this kind of machine; on a slower or busier one it grows in proportion to that floor,
measured interleaved with the command's runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import ckstore
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}

NO_TORCH = """
import runpy, sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (importing {name})")
        return None

sys.meta_path.insert(0, _NoTorch())
sys.argv[0] = "ckstore"
runpy.run_module("ckstore.cli", run_name="__main__", alter_sys=True)
"""


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CKSTORE_STORE", "PYTHONDONTWRITEBYTECODE")  # an install has .pyc files
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def no_torch(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``ckstore ARGS`` in an interpreter where importing torch fails."""
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs, a tag, an optimizer, RNG state and plain values: what a real state holds."""
    path = tmp_path_factory.mktemp("notorch") / "store"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    optim = torch.optim.AdamW(model.parameters())
    state = {
        "model": model,
        "optim": optim,
        "rng": ckstore.RNGState(),
        "progress": ckstore.StateDict(step=1, lr=0.1, names=["a", "b"]),
    }
    with ckstore.open(path, **TINY, create=True) as store:
        store.take(state, run="r", step=1, tags=["best"])
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        store.take(state, run="r", step=2)
        store.take(state, run="q", step=1)
    return path


def test_the_blocker_blocks() -> None:
    p = subprocess.run(
        [sys.executable, "-c", NO_TORCH.replace("runpy.run_module", "import torch #"), "x"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        check=False,
    )
    assert p.returncode != 0 and "torch is blocked" in p.stderr


def test_opening_a_store_imports_nothing_heavy(small_store: Path) -> None:
    """What the read path must not pay for at import: each costs 0.1 to 3 s."""
    code = (
        "import sys, ckstore, ckstore.cli\n"
        f"ckstore.open({str(small_store)!r}, create=False).log()\n"
        "heavy = ['torch', 'numpy', 'alembic', 'fsspec', 'sqlalchemy.orm']\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


def test_read_commands_run_without_torch(small_store: Path, tmp_path: Path) -> None:
    s = ("--store", str(small_store))
    scratch = tmp_path / "scratch"
    shutil.copytree(small_store, scratch)
    w = ("--store", str(scratch))
    reads = [
        ("log", *s),
        ("log", "--json", *s),
        ("show", "best", *s),
        ("ls", "r@2", *s),
        ("diff", "r@1", "r@2", *s),
        ("diff", "best", "r@2", "--json", *s),
        ("tag", *s),
        ("du", *s),
        ("check", *s),
        ("check", "--read-data", *s),
        ("gc", "--dry-run", "--keep-last", "1", *s),
        ("--version",),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda a: no_torch(*a), reads))
    for argv, p in zip(reads, results):
        assert p.returncode == 0 and p.stdout.strip(), (argv, p.stderr)
        assert "Traceback" not in p.stderr, (argv, p.stderr)
    by_name = {" ".join(a[:2]): p.stdout for a, p in zip(reads, results)}
    assert "r@2" in by_name["log --store"] and "best" in by_name["log --store"]
    assert len(json.loads(by_name["log --json"])) == 3
    assert "ok: True" in by_name["check --read-data"]
    assert json.loads(by_name["diff best"])["counts"]["changed"] > 0
    # and the commands that change the store
    for argv in (
        ("tag", "r@2", "mine", *w),
        ("rm", "q", *w),
        ("rm", "r@1", "--force", *w),
        ("gc", "--keep-last", "1", "--grace", "0s", *w),
    ):
        p = no_torch(*argv)
        assert p.returncode == 0 and "Traceback" not in p.stderr, (argv, p.stderr)
    with ckstore.open(scratch, create=False) as store:
        assert [x.ref.split()[0] for x in store.log()] == ["r@2"]
        assert store.tags() == {"mine": store.get("r@2").id}
