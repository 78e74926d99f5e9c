"""``ckstore cat REF KEY`` and shell completion (issue 27, items 18 and 19)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli, objects
from ckstore.cli import _complete
from tests.support.cli import run
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cat") / "s"
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    w[0, 0], w[0, 1], w[0, 2] = float("nan"), float("inf"), 0.0
    state = ckstore.StateDict(
        w=w, other=torch.randn(64, 128), half=torch.randn(40, 40).to(torch.bfloat16),
        ids=torch.arange(100, dtype=torch.int64), step=7, betas=(0.9, 0.999), note="hello",
        raw=b"\x00\x01", nested={"lr": 0.1},
    )  # fmt: skip
    with ckstore.open(path, create=True, **TINY) as store:
        store.take({"m": state}, run="sft", step=7, tags=["best"])
        store.take({"m": state}, run="sft", step=8)
        store.take({"x": ckstore.StateDict(v=torch.ones(3))}, run="other", step=1, name="named-one")
    return path


# --- item 19: cat -------------------------------------------------------------------------------
def test_cat_values_as_json(store_path, capsys) -> None:
    s = ("--store", str(store_path))
    assert run(capsys, *s, "cat", "sft@7", "m/step")[:2] == (0, "7\n")
    code, out, _ = run(capsys, *s, "cat", "best", "m/betas")
    assert code == 0 and json.loads(out) == [0.9, 0.999]
    code, out, _ = run(capsys, *s, "cat", "best", "m/note", "--json")
    assert json.loads(out) == {"key": "m/note", "kind": "value", "value": "hello"}
    code, out, _ = run(capsys, *s, "cat", "best", "m/raw", "--json")
    assert json.loads(out)["value"] == {"base64": "AAE="}


def test_cat_summarises_a_tensor(store_path, capsys) -> None:
    s = ("--store", str(store_path))
    with ckstore.open(store_path) as store:
        w = store.get("best").read_object("m/w").double()
    finite = w[torch.isfinite(w)]
    code, out, _ = run(capsys, *s, "cat", "best", "m/w", "--json")
    d = json.loads(out)
    assert code == 0 and (d["dtype"], d["shape"], d["nbytes"]) == (
        "float32",
        [64, 128],
        64 * 128 * 4,
    )
    assert (d["nan"], d["inf"], d["zeros"]) == (1, 1, 1)
    assert d["min"] == pytest.approx(float(finite.min())) and d["max"] == pytest.approx(
        float(finite.max())
    )
    assert d["mean"] == pytest.approx(float(finite.mean())) and d["std"] == pytest.approx(
        float(finite.std(correction=0))
    )
    assert d["norm"] == pytest.approx(float(finite.norm()))
    assert d["head"][:3] == ["nan", "inf", 0.0] and len(d["head"]) == 8
    code, out, _ = run(capsys, *s, "cat", "best", "m/half")
    assert code == 0 and "bfloat16" in out and "[40, 40]" in out and "norm:" in out
    code, out, _ = run(capsys, *s, "cat", "best", "m/ids", "--json")
    d = json.loads(out)
    assert (d["min"], d["max"], d["mean"], d["head"][:3]) == (0.0, 99.0, 49.5, [0, 1, 2])
    assert math.isclose(d["std"], float(torch.arange(100, dtype=torch.float64).std(correction=0)))


def test_cat_reads_only_that_tensors_chunks(store_path, tmp_path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(store_path, copy)
    with ckstore.open(copy) as store:
        snap = store.get("best")
        target = set(c.id for c in snap.manifest.entries["m/w"].chunks)
        other = next(c.id for c in snap.manifest.entries["m/other"].chunks if c.id not in target)
        loc = store.repository.index.chunk_locations([other])[other]
        pack = Path(store.url) / objects.pack_name(loc.pack_id)
    data = bytearray(pack.read_bytes())
    data[loc.offset + loc.length // 2] ^= 1  # damage a chunk of another tensor
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    s = ("--store", str(copy))
    assert run(capsys, *s, "cat", "best", "m/w")[0] == 0  # never read the damaged chunk
    assert run(capsys, *s, "cat", "best", "m/other")[0] == 5  # but it is damaged


def test_cat_errors(store_path, capsys) -> None:
    s = ("--store", str(store_path))
    code, _, err = run(capsys, *s, "cat", "best", "m/nested")
    assert code == 2 and "m/nested/lr" in err
    code, _, err = run(capsys, *s, "cat", "best", "m/nope")
    assert code == 3 and "no key 'm/nope'" in err


def test_cat_of_a_value_does_not_import_torch(store_path) -> None:
    blocker = (
        "import runpy, sys\n"
        "class B:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, B())\n"
        "sys.argv[0] = 'ckstore'\n"
        "runpy.run_module('ckstore.cli', run_name='__main__', alter_sys=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", blocker, "--store", str(store_path), "cat", "best", "m/note"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == '"hello"\n', done.stderr


# --- item 18: completion ------------------------------------------------------------------------
def _complete_words(*words: str) -> list[str]:
    return _complete.candidates(list(words), cli.build_parser())


def test_candidates(store_path, monkeypatch) -> None:
    monkeypatch.setenv(cli.STORE_ENV, str(store_path))
    assert "show" in _complete_words("") and _complete_words("sh") == ["show"]
    assert "__complete" not in _complete_words("")
    assert "--keep-last" in _complete_words("gc", "--k")
    assert set(_complete_words("show", "")) == {"best", "sft", "other", "named-one"}
    assert _complete_words("show", "sft@") == ["sft@7", "sft@8"]
    assert _complete_words("diff", "sft@7", "b") == ["best"]
    assert _complete_words("cat", "best", "m/b") == ["m/betas"]
    assert _complete_words("ls", "sft", "") == ["m/"]  # one path level at a time
    assert "m/w" in _complete_words("ls", "sft", "m/")
    assert _complete_words("cat", "best", "m/ne") == ["m/nested/"]
    assert _complete_words("cat", "best", "m/nested/") == ["m/nested/lr"]
    assert _complete_words("tag", "--delete", "") == ["best"]
    assert _complete_words("log", "--run", "o") == ["other"]
    assert _complete_words("export", "best", "") == [_complete.FILES]
    assert _complete_words("completion", "") == ["bash", "zsh", "fish"]
    assert _complete_words("show", "best", "") == []  # show takes one ref
    monkeypatch.delenv(cli.STORE_ENV)
    assert _complete_words("--store", str(store_path), "show", "b") == ["best"]


def test_keys_complete_one_level_at_a_time_for_a_large_model() -> None:
    """A 7B model's keys: at most a few dozen candidates at any TAB, never thousands."""
    keys = [
        f"model/model.layers.{i}.{part}.weight"
        for i in range(32)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm")
    ] + ["model/model.embed_tokens.weight", "model/lm_head.weight"] + [
        f"optim/state/{i}/{m}" for i in range(291) for m in ("step", "exp_avg", "exp_avg_sq")
    ]  # fmt: skip
    assert _complete.next_level(keys, "") == ["model/", "optim/"]
    assert _complete.next_level(keys, "model/") == ["model/lm_head.", "model/model."]
    assert _complete.next_level(keys, "model/model.") == [
        "model/model.embed_tokens.", "model/model.layers."
    ]  # fmt: skip
    assert len(_complete.next_level(keys, "model/model.layers.")) == 32
    assert _complete.next_level(keys, "model/model.layers.3.mlp.") == [
        "model/model.layers.3.mlp.down_proj.",
        "model/model.layers.3.mlp.gate_proj.",
        "model/model.layers.3.mlp.up_proj.",
    ]
    assert _complete.next_level(keys, "model/lm_head.w") == ["model/lm_head.weight"]
    assert len(_complete.next_level(keys, "optim/state/")) == 291


def test_complete_command_never_fails(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.STORE_ENV, raising=False)
    assert cli.main(["__complete", "show", ""]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_bash_completion_end_to_end(store_path, tmp_path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    exe = Path(sys.executable).parent / "ckstore"
    assert exe.exists()
    script = (
        "source <(ckstore completion bash)\n"
        'COMP_WORDS=(ckstore show b); COMP_CWORD=2; _ckstore_complete; echo "1:${COMPREPLY[*]}"\n'
        'COMP_WORDS=(ckstore cat best m/no); COMP_CWORD=3; _ckstore_complete; echo "2:${COMPREPLY[*]}"\n'
        'COMP_WORDS=(ckstore export best ""); COMP_CWORD=3; _ckstore_complete; echo "3:${COMPREPLY[*]}"\n'
        'COMP_WORDS=(ckstore cat best m/ne); COMP_CWORD=3; _ckstore_complete; echo "4:${COMPREPLY[*]}"\n'
    )
    (tmp_path / "afile").write_text("x")
    env = {
        **os.environ,
        "PATH": f"{exe.parent}{os.pathsep}{os.environ['PATH']}",
        cli.STORE_ENV: str(store_path),
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [bash, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "1:best" and lines[1] == "2:m/note" and lines[2] == "3:afile"
    assert lines[3] == "4:m/nested/"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_every_script_parses(shell, capsys) -> None:
    assert cli.main(["completion", shell]) == 0
    text = capsys.readouterr().out
    assert "ckstore __complete" in text
    exe = shutil.which(shell)
    if exe is None:  # `make test` installs it (scripts/ensure-test-tools.sh); CI must run this
        if os.environ.get("CI"):
            pytest.fail(f"{shell} is not installed: CI must parse its completion script")
        pytest.skip(f"{shell} is not installed here (make test installs it, as root)")
    done = subprocess.run(
        [exe, "-n"], input=text, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
