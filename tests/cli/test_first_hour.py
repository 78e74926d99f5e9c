"""A new user's first hour, through the real command line (issue 27): the README quick start,
its import/export/tag lines, the demo, then the mistakes people make (typos, malformed refs,
a tag named like a run, a taken tag, a non-empty export folder, Ctrl-C and SIGTERM mid-import,
two writers at once, a flipped bit, a read-only store, ``--json`` scripts).

Every command runs in a fresh process. None may print a traceback, every exit code is the
documented one (``ckstore --help``: 0 ok, 1 check found problems, 2 usage, 3 not found,
4 conflict, 5 corruption, 6 other), and every error is one ``ckstore: error:`` line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckstore import cli
from tests.support.paths import REPO

CK = [sys.executable, "-m", "ckstore.cli"]


class Session:
    """A terminal in a fresh folder: runs commands, keeps the transcript, checks each one."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.transcript: list[str] = []

    def check(
        self, args: list[str], p: subprocess.CompletedProcess[str], code: int
    ) -> subprocess.CompletedProcess[str]:
        self.transcript.append(f"$ {' '.join(args)}  -> {p.returncode}\n{p.stdout}{p.stderr}")
        where = "\n".join(self.transcript[-1:])
        assert "Traceback" not in p.stdout + p.stderr, where
        assert p.returncode == code, where
        if code not in (0, 1):
            errors = [line for line in p.stderr.splitlines() if line]
            assert len(errors) == 1 and errors[0].startswith("ckstore: error: "), where
        return p

    def ck(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            CK + list(args),
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        return self.check(["ckstore", *args], p, code)

    def py(self, code_text: str, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [sys.executable, "-c", code_text, *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        return self.check(["python", "-c", "..."], p, code)

    def interrupted(self, sig: int, *args: str) -> subprocess.CompletedProcess[str]:
        """``ckstore ARGS`` stopped by ``sig`` while its take commits (the commit is held)."""
        hold = (
            "import sys, time\n"
            "from ckstore import cli\n"
            "from ckstore.index import Index\n"
            "def held(self, *a, **k):\n"
            "    print('COMMITTING', flush=True)\n"
            "    time.sleep(60)\n"
            "Index.commit_snapshot = held\n"
            "sys.exit(cli.main(sys.argv[1:]))\n"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", hold, *args],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # a shell runs a background job (`nohup make test &`) with SIGINT ignored, and the
            # child would inherit that: Ctrl-C must reach it as it reaches a user's command
            preexec_fn=_default_sigint,
        )
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.strip() == "COMMITTING", first
        child.send_signal(sig)
        out, err = child.communicate(timeout=60)
        return subprocess.CompletedProcess(child.args, child.returncode, first + out, err)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _readme_quick_start() -> str:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


def test_the_first_hour(tmp_path: Path) -> None:
    me = Session(tmp_path)
    # --- the README: make test's quick start, then the command line on its store ---------------
    me.py(_readme_quick_start())
    s = ("--store", "ckpts")
    log = json.loads(me.ck("log", "--json", *s).stdout)
    assert [(r["run"], r["step"], r["tags"]) for r in log] == [("sft", 100, ["best"])]
    me.ck("show", "best", *s)
    me.ck("ls", "best", *s)
    me.ck("cat", "best", "model/weight", *s)
    me.ck("cat", "sft@100", "progress/step", *s)
    me.ck("diff", "sft@100", "best", "--numeric", *s)
    me.ck("du", *s)
    me.ck("check", "--read-data", *s)
    me.ck("export", "best", "out-torch", "--format", "torch", *s)
    me.py(
        "import torch; sd = torch.load('out-torch/checkpoint.pt'); assert 'model' in sd"
    )  # weights_only
    me.ck("export", "best", "out-hf", "--keys", "model/**", *s)
    me.py(
        "from safetensors.torch import save_file; import torch; save_file({'w': torch.ones(64, 64)}, 'w.safetensors')"
    )
    me.ck(
        "import", "w.safetensors", "--run", "base", "--tag", "base", *s, code=4
    )  # the README once did this
    me.ck("import", "w.safetensors", "--run", "base", "--tag", "llama-1b", *s)
    me.ck("tag", "sft@100", "best", *s, code=4)  # exists: the message says --force
    me.ck("tag", "sft@100", "best", "--force", *s)
    # --- the demo ---------------------------------------------------------------------------------
    demo = me.ck("--store", "demo", "demo", "--steps", "4", "--every", "1")
    assert "loss curves bit-identical: True" in demo.stdout
    me.ck("--store", "demo2", "demo", "--steps", "3", code=2)
    # --- mistakes ---------------------------------------------------------------------------------
    me.ck("log", "--store", "ckpst", code=3)  # a typo: no store made there
    assert not (tmp_path / "ckpst").exists()
    (tmp_path / "a-file").write_text("x")
    me.ck("init", "a-file/sub", code=2)
    me.ck("init", "out-hf", code=4)  # not empty, not a store
    me.ck("show", "@5", *s, code=2)
    me.ck("show", "sft@", *s, code=2)
    me.ck("show", "nope", *s, code=3)
    near = me.ck("show", "sft@41", *s, code=3).stderr  # the run's steps, not "no such run"
    assert "run 'sft' has 1 snapshot; its steps: 100" in near
    assert "Did you mean 'sft'?" in me.ck("show", "sfft", *s, code=3).stderr
    me.ck("log", "--run", "nope", *s, code=3)
    me.ck("gc", "--run", "nope", "--keep-last", "1", *s, code=3)  # as log --run: no such run
    me.ck("cat", "best", "model/nope", *s, code=3)
    assert "did you mean 'model/weight'" in me.ck("cat", "best", "model/wieght", *s, code=3).stderr
    me.ck("tag", "sft@100", "sft", *s, code=4)  # a tag would hide the run
    me.ck(
        "import", "w.safetensors", "--run", "base", "--tag", "llama-1b", *s, code=4
    )  # tags move only when asked
    me.ck("export", "best", "out-hf", *s, code=4)  # not empty
    me.ck("gc", "--older-than", "soon", *s, code=2)
    me.ck("frobnicate", code=2)
    bad = me.ck("show", "nope", "--json", *s, code=3)
    assert json.loads(bad.stdout)["error"]["exit_code"] == 3
    me.py(
        "import ckstore, torch\n"
        "store = ckstore.open('ckpts')\n"
        "try:\n"
        "    store.get('sft').restore({'model': torch.nn.Linear(3, 3)})\n"
        "except ckstore.MismatchError as exc:\n"
        "    print('refused:', exc)\n"
        "try:\n"
        "    ckstore.open('ckpst')\n"
        "except ckstore.NotFoundError as exc:\n"
        "    print('refused:', exc)\n"
    )
    # Ctrl-C and SIGTERM mid-import: nothing committed, the lease released at once
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        p = me.interrupted(sig, "import", "w.safetensors", "--run", "stopped", *s)
        me.check(["ckstore import (signal)"], p, code)
    held = json.loads(me.ck("du", "--json", *s).stdout)["sessions"]
    assert held == [] and "stopped" not in me.ck("log", *s).stdout
    # two writers at once into one run
    with ThreadPoolExecutor(2) as pool:
        both = list(
            pool.map(
                lambda i: me.ck("import", "w.safetensors", "--run", "two", "--step", str(i), *s),
                (1, 2),
            )
        )
    assert all(p.returncode == 0 for p in both)
    assert len(json.loads(me.ck("log", "--run", "two", "--json", *s).stdout)) == 2
    # a flipped bit: check names what it breaks, reading it is a corruption error
    me.py(
        "import ckstore\nfrom pathlib import Path\nfrom ckstore import objects\n"
        "store = ckstore.open('ckpts')\n"
        "cid = store.get('best').manifest.entries['model/weight'].chunks[0].id\n"
        "loc = store.repository.index.chunk_locations([cid])[cid]\n"
        "path = Path(store.url) / objects.pack_name(loc.pack_id)\n"
        "data = bytearray(path.read_bytes()); data[loc.offset + 5] ^= 1\n"
        "path.chmod(0o644); path.write_bytes(bytes(data))\n"
    )
    checked = me.ck("check", "--read-data", *s, code=1)
    assert "sft@100" in checked.stdout and "model/weight" in checked.stdout
    me.ck("cat", "best", "model/weight", *s, code=5)
    # a published store opened read-only; whole runs; gc without a terminal
    me.ck("--read-only", "tag", "llama-1b", "v1", *s, code=6)
    me.ck("rm", "--run", "two", "--yes", *s)
    me.ck("gc", "--keep-last", "0", "--grace", "0s", *s)
    me.ck("completion", "bash")
    assert len(me.transcript) > 40


def test_ctrl_c_reaches_a_command_when_the_tests_run_in_the_background(tmp_path: Path) -> None:
    """``nohup make test &``: the shell starts the background job with SIGINT ignored, which
    every child inherits; the interrupted import must still stop on SIGINT at once (130), not
    hang until its hold ends."""
    me = Session(tmp_path)
    me.ck("init", "ckpts")
    me.py(
        "from safetensors.torch import save_file; import torch; "
        "save_file({'w': torch.ones(64, 64)}, 'w.safetensors')"
    )
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &`
    try:
        p = me.interrupted(signal.SIGINT, "import", "w.safetensors", "--store", "ckpts")
    finally:
        signal.signal(signal.SIGINT, before)
    me.check(["ckstore import (SIGINT, parent ignoring it)"], p, 130)
    assert "interrupted (Ctrl-C)" in p.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version(tmp_path: Path, argv: list[str]) -> None:
    Session(tmp_path).ck(*argv)
