"""The ``ckstore`` command line, run as a real executable in subprocesses.

Every subprocess pays Python's start and the CLI's imports (about half a second; the torch
import, 2 s or more, only for ``diff --numeric``), so independent read-only calls run
concurrently and each test groups several calls.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ckstore
from ckstore import cli
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def ck(
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    exe: list[str] | None = None,
):
    """Run the CLI; returns CompletedProcess with text stdout/stderr."""
    cmd = (exe or [sys.executable, "-m", "ckstore.cli"]) + list(args)
    return subprocess.run(
        cmd, check=False, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=120
    )


def ck_many(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """Run several independent CLI calls at once; each call is (args tuple, kwargs dict)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda c: ck(*c[0], **c[1]), calls))


def ok_json(p: subprocess.CompletedProcess):
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def one_error_line(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckstore: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _build(path: Path) -> None:
    torch.manual_seed(0)
    w = torch.randn(10, 256)
    with ckstore.open(path, **TINY, create=True) as store:
        store.take(
            {"m": ckstore.StateDict(w=w, b=torch.zeros(3), lr=0.1)},
            run="r",
            step=1,
            metadata={"loss": 1.5},
        )
        w2 = w.clone()
        w2[3] += 1
        state = {"m": ckstore.StateDict(w=w2, b=torch.zeros(3), lr=0.1, extra=torch.ones(100))}
        store.take(state, run="r", step=2, tags=["best"])
        store.take(state, run="q", step=5)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A read-only store with runs r (steps 1, 2; tag best on r@2) and q (step 5)."""
    path = tmp_path_factory.mktemp("cli") / "store"
    _build(path)
    (path / "sub" / "dir").mkdir(parents=True)
    return path


@pytest.fixture
def scratch(shared, tmp_path):
    """A private copy of the shared store, for commands that change it."""
    path = tmp_path / "store"
    shutil.copytree(shared, path)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in this process (no torch import to pay): (exit code, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse usage errors and --help
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line_inproc(result: tuple[int, str, str], code: int, *words: str) -> None:
    one_error_line(
        SimpleNamespace(returncode=result[0], stdout=result[1], stderr=result[2]), code, *words
    )


def test_read_commands_json(shared, capsys):
    s = ("--store", str(shared))
    log, show, ls, diff, du = ck_many(
        (("log", "--json", *s), {}),
        (("show", "best", "--json", *s), {}),
        (("ls", "r@1", "m/", "--json", *s), {}),
        (("diff", "r@1", "best", "--numeric", "--json", *s), {}),
        (("du", "--json", *s), {}),
    )
    rows = ok_json(log)
    assert [(r["run"], r["step"]) for r in rows] == [("q", 5), ("r", 2), ("r", 1)]
    assert (
        rows[1]["tags"] == ["best"]
        and rows[0]["new_bytes"] == 0
        and rows[2]["metadata"] == {"loss": 1.5}
    )
    d = ok_json(show)
    assert (d["run"], d["step"], d["tags"]) == ("r", 2, ["best"]) and d["stored_bytes"] > 0
    assert d["entries"] == {"tensors": 3, "values": 1} and d["parent_id"] == rows[2]["id"]
    entries = {e["key"]: e for e in ok_json(ls)}
    assert entries["m/w"] == {
        "key": "m/w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [10, 256],
        "bytes": 10240,
    }
    assert entries["m/lr"]["kind"] == "value" and set(entries) == {"m/w", "m/b", "m/lr"}
    dd = ok_json(diff)
    assert dd["counts"] == {"added": 1, "removed": 0, "changed": 1, "unchanged": 2}
    w = next(k for k in dd["keys"] if k["key"] == "m/w")
    assert (w["changed_chunks"], w["total_chunks"]) == (1, 10) and w["numeric"][
        "max_abs_diff"
    ] == pytest.approx(1.0)
    usage = ok_json(du)
    runs = {r["run"]: r for r in usage["runs"]}
    assert runs["r"]["snapshots"] == 2 and runs["q"]["snapshots"] == 1
    assert (
        usage["total"]["snapshots"] == 3
        and usage["total"]["pack_bytes"] >= usage["total"]["stored_bytes"]
    )
    assert usage["total"]["logical_bytes"] == sum(r["logical_bytes"] for r in rows)
    _check_du_against_index(shared, runs, usage["total"])
    # the same CLI in-process: more option combinations
    code, out, _ = run_cli(capsys, "log", "--run", "r", "-n", "1", "--json", *s)
    assert code == 0 and [(r["run"], r["step"]) for r in json.loads(out)] == [("r", 2)]
    code, out, _ = run_cli(capsys, *s, "--json", "log")  # global options before the command
    assert code == 0 and json.loads(out) == rows
    code, out, _ = run_cli(capsys, "tag", "--list", "--json", *s)
    assert code == 0 and [(t["name"], t["run"], t["step"]) for t in json.loads(out)] == [
        ("best", "r", 2)
    ]


def _check_du_against_index(path: Path, runs: dict, total: dict) -> None:
    with ckstore.open(path, create=False) as store:
        chunks: dict[str, set[str]] = {}
        for snap in store.log():
            chunks.setdefault(snap.run, set()).update(
                store.repository.index.snapshot_chunk_ids(snap.id)
            )
        everything = set().union(*chunks.values())
        locs = store.repository.index.chunk_locations(everything)
    for run, ids in chunks.items():
        assert runs[run]["stored_bytes"] == sum(locs[i].length for i in ids)
        assert runs[run]["dedup_ratio"] == pytest.approx(
            runs[run]["logical_bytes"] / runs[run]["stored_bytes"]
        )
    assert total["stored_bytes"] == sum(loc.length for loc in locs.values()) and total[
        "chunks"
    ] == len(everything)


def test_read_commands_human(shared, capsys):
    s = ("--store", str(shared))
    log = ck("log", *s)
    assert log.returncode == 0 and log.stderr == "", log.stderr
    assert log.stdout.splitlines()[0].split() == [
        "id",
        "snapshot",
        "time",
        "logical",
        "new",
        "health",
        "tags",
    ]
    assert "r@2" in log.stdout and "best" in log.stdout and "KiB" in log.stdout
    outputs = {}
    for argv in (
        ("show", "r@1"),
        ("ls", "best"),
        ("diff", "r@1", "r@2", "--numeric"),
        ("du",),
        ("tag",),
    ):
        code, out, err = run_cli(capsys, *argv, *s)
        assert code == 0 and err == "", (argv, err)
        outputs[argv[0]] = out
    assert "loss" in outputs["show"] and "run:" in outputs["show"]
    assert (
        "m/extra" in outputs["ls"] and "float32" in outputs["ls"] and "4 entries" in outputs["ls"]
    )
    diff = outputs["diff"]
    assert (
        "1/10 (10%)" in diff and "+  m/extra" in diff and "1 changed" in diff and "max|b-a|" in diff
    )
    assert "(total)" in outputs["du"] and "packs on the backend" in outputs["du"]
    assert outputs["tag"].split()[4] == "best"


def test_store_discovery_and_console_script(shared, tmp_path, capsys, monkeypatch):
    exe = Path(sys.executable).parent / "ckstore"
    assert exe.exists(), "the console script is installed next to the interpreter"
    nowhere = tmp_path / "empty"
    nowhere.mkdir()
    by_cwd, by_env, script, missing = ck_many(
        (("log", "--json"), {"cwd": shared / "sub" / "dir"}),
        (("log", "--json"), {"cwd": nowhere, "env": _env(CKSTORE_STORE=str(shared))}),
        (("show", "best", "--json"), {"cwd": shared, "exe": [str(exe)]}),
        (("log",), {"cwd": nowhere}),
    )
    assert len(ok_json(by_cwd)) == 3 and len(ok_json(by_env)) == 3
    assert ok_json(script)["step"] == 2
    one_error_line(missing, 3, "no ckstore store", "ckstore init")
    monkeypatch.delenv(cli.STORE_ENV, raising=False)
    one_error_line_inproc(
        run_cli(capsys, "log", "--store", str(nowhere / "no-such-store")), 3, "no-such-store"
    )


def test_errors_are_one_line_with_exit_codes(shared, capsys):
    s = ("--store", str(shared))
    unknown_ref, bad_tag, unknown_cmd = ck_many(
        (("show", "nope", *s), {}),
        (("tag", "r@1", "../x", *s), {}),
        (("frobnicate", *s), {}),
    )
    one_error_line(unknown_ref, 3, "'nope'")
    one_error_line(bad_tag, 2, "'../x'")
    one_error_line(unknown_cmd, 2, "frobnicate")
    cases = [
        (("tag", "r@1", "a b"), 2, "'a b'"),
        (("tag", "nope", "ok-name"), 3, "'nope'"),
        (("diff", "r@1", "nope"), 3, "'nope'"),
        (("ls", "r@1", "zzz"), 3, "zzz"),
        (("tag", "r@1", "best"), 4, "--force"),
        (("tag", "r@1"), 2, "NAME"),
        (("check", "--read-data", "2"), 2, "fraction"),
        (("gc", "--older-than", "soon"), 2, "duration"),
        (("log", "-n", "-3"), 2, "non-negative"),
        (("show",), 2, "ref"),
    ]
    for argv, code, word in cases:
        one_error_line_inproc(run_cli(capsys, *argv, *s), code, word)


def test_tag_and_rm_change_the_store(scratch, capsys):
    s = ("--store", str(scratch))
    made, gone = ck("tag", "r@1", "first", "--json", *s), ck("rm", "r@1", "--force", "--json", *s)
    assert ok_json(made) == {
        "tag": "first",
        "snapshot_id": ok_json(made)["snapshot_id"],
        "run": "r",
        "step": 1,
    }
    gone_id = ok_json(gone)["deleted"][0]
    assert ok_json(gone)["tags_deleted"] == ["first"]
    assert gone_id == ok_json(made)["snapshot_id"]
    code, out, _ = run_cli(capsys, "log", "--json", *s)
    assert (
        code == 0
        and gone_id not in {r["id"] for r in json.loads(out)}
        and len(json.loads(out)) == 2
    )
    code, out, _ = run_cli(capsys, "tag", "--list", "--json", *s)
    assert [t["name"] for t in json.loads(out)] == ["best"]  # the tag went with its snapshot
    code, out, _ = run_cli(capsys, "tag", "r", "new", *s)
    assert code == 0 and "tagged r@2" in out
    code, out, _ = run_cli(capsys, "tag", "q", "new", "--force", *s)
    assert code == 0 and "tagged q@5" in out
    code, out, _ = run_cli(capsys, "tag", "--delete", "new", "--json", *s)
    assert code == 0 and json.loads(out) == {"deleted": "new"}
    one_error_line_inproc(run_cli(capsys, "tag", "--delete", "new", *s), 3, "new")
    one_error_line_inproc(run_cli(capsys, "rm", "r@1", *s), 3, "r@1")
    one_error_line_inproc(run_cli(capsys, "rm", "q", "r", *s), 4, "best", "--force")
    code, out, _ = run_cli(capsys, "rm", "q", "r", "--force", *s)
    assert code == 0 and "ckstore gc" in out and "and its tags best" in out
    code, out, _ = run_cli(capsys, "log", "--json", *s)
    assert json.loads(out) == []


def test_init(tmp_path, capsys, monkeypatch):
    target = tmp_path / "new"
    made = ok_json(
        ck("init", str(target), "--chunk-bytes", "2KiB", "--pack-bytes", "16KiB", "--json")
    )
    assert (made["chunk_bytes"], made["pack_bytes"]) == (2048, 16384)
    assert (target / "ckstore.json").is_file()
    with ckstore.open(target, create=False) as store:
        assert store.config.chunk_bytes == 2048 and store.log() == []
    one_error_line_inproc(run_cli(capsys, "init", str(target)), 4, "already exists")
    one_error_line_inproc(
        run_cli(capsys, "init", str(tmp_path / "x"), "--chunk-bytes", "lots"), 2, "not a size"
    )
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv(cli.STORE_ENV, raising=False)
    code, out, _ = run_cli(capsys, "init")
    assert (
        code == 0 and "initialized empty ckstore store" in out and (here / "ckstore.json").is_file()
    )
    code, out, _ = run_cli(capsys, "log", "--json")  # found from the current directory
    assert code == 0 and json.loads(out) == []
    code, out, _ = run_cli(capsys, "migrate", "--json")
    assert code == 0 and json.loads(out)["revision"] == ckstore.index.head_revision()


def test_gc_and_check_run_against_the_store(scratch, capsys):
    """Needs store.gc (ckstore/_gc.py) and store.check (ckstore/_check.py)."""
    s = ("--store", str(scratch))
    dry, read = ck_many(
        (("gc", "--dry-run", "--keep-last", "1", "--json", *s), {}),
        (("check", "--read-data", "--json", *s), {}),
    )
    assert isinstance(ok_json(dry), dict) and ok_json(read)["ok"] is True
    code, out, _ = run_cli(capsys, "gc", "--dry-run", "--keep-last", "1", *s)
    assert code == 0 and out.strip()
    code, out, _ = run_cli(capsys, "check", *s)
    assert code == 0 and "ok: True" in out
    with ckstore.open(scratch, create=False) as store:
        assert len(store.log()) == 3  # a dry run deletes nothing


# --- in-process: argument mapping and help (no subprocess needed) ------------------------------
def _args(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_gc_arguments_map_to_store_gc():
    a = _args(
        "gc",
        "--keep-last",
        "3",
        "--keep-every-steps",
        "1000",
        "--older-than",
        "7d",
        "--run",
        "sft",
        "--run",
        "rl",
        "--no-keep-tagged",
        "--grace",
        "12h",
        "--repack-below",
        "0.3",
        "--dry-run",
    )
    assert cli.gc_policy(a) == {
        "keep_last": 3,
        "keep_every_steps": 1000,
        "older_than": 7 * 86400.0,
        "runs": ["sft", "rl"],
        "keep_tagged": False,
        "grace_seconds": 12 * 3600.0,
        "repack_below": 0.3,
        "dry_run": True,
        "keep_healthy": True,
    }
    assert cli.gc_policy(_args("gc")) == {
        "dry_run": False,
        "keep_tagged": True,
        "keep_healthy": True,
    }
    assert cli.gc_policy(_args("gc", "--no-keep-healthy"))["keep_healthy"] is False
    assert _args("check").read_data is False
    assert _args("check", "--read-data").read_data is True
    assert _args("check", "--read-data", "0.25").read_data == 0.25


class _Report:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def to_dict(self):
        return {
            "ok": self.ok,
            "problems": [] if self.ok else [{"pack": "ab12", "error": "bad"}],
            "checked_bytes": 4096,
        }


def test_gc_and_check_call_the_store(shared, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(
        ckstore.Store, "gc", lambda self, **kw: seen.setdefault("gc", kw) and _Report(True)
    )
    monkeypatch.setattr(
        ckstore.Store,
        "check",
        lambda self, read_data=False, progress=None: (
            seen.setdefault("check", read_data) is not None and _Report(read_data != 0.5)
        ),
    )
    assert (
        cli.main(
            ["--store", str(shared), "gc", "--keep-last", "2", "--older-than", "90m", "--json"]
        )
        == 0
    )
    assert seen["gc"] == {
        "keep_last": 2,
        "older_than": 5400.0,
        "dry_run": False,
        "keep_tagged": True,
        "keep_healthy": True,
        "progress": None,  # --json draws no bar
    }
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli.main(["--store", str(shared), "check", "--read-data", "0.5"]) == 1
    assert seen["check"] == 0.5
    out = capsys.readouterr().out
    assert "ok: False" in out and "checked_bytes: 4.0 KiB" in out


def test_help_everywhere(capsys):
    for argv in [["--help"]] + [[c.name, "--help"] for c in cli.COMMANDS]:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and "usage: ckstore" in out, argv
    p = ck("--help")
    assert p.returncode == 0 and "Exit codes" in p.stdout and "diff" in p.stdout


def test_exit_code_table():
    from ckstore import errors

    assert cli.exit_code(errors.SnapshotNotFoundError("x")) == 3
    assert cli.exit_code(errors.KeyNotFoundError("x")) == 3
    assert cli.exit_code(errors.ConflictError("x")) == 4
    assert cli.exit_code(errors.LeaseExpiredError("x")) == 4
    assert cli.exit_code(errors.CorruptionError("x")) == 5
    assert cli.exit_code(errors.ObjectNotFoundError("x")) == 5
    assert cli.exit_code(errors.InvalidInputError("x")) == 2
    assert cli.exit_code(errors.SchemaError("x")) == 6
    assert cli.exit_code(errors.MismatchError("x")) == 6


def test_find_store_walks_up(shared, monkeypatch):
    monkeypatch.delenv(cli.STORE_ENV, raising=False)
    assert cli.find_store(None, cwd=str(shared / "sub" / "dir")) == str(shared)
    assert cli.find_store("explicit") == "explicit"
    monkeypatch.setenv(cli.STORE_ENV, "from-env")
    assert cli.find_store(None, cwd="/") == "from-env"
