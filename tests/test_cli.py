"""The ``ckstore`` command line, run as a real executable in subprocesses.

Every subprocess pays the torch import (~2 s), so independent read-only calls run concurrently
and each test groups several calls.
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
from ckstore import cli

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def ck(*args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None, exe: list[str] | None = None):
    """Run the CLI; returns CompletedProcess with text stdout/stderr."""
    cmd = (exe or [sys.executable, "-m", "ckstore.cli"]) + list(args)
    return subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=120)


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
    with ckstore.open(path, **TINY) as store:
        store.take({"m": ckstore.StateDict(w=w, b=torch.zeros(3), lr=0.1)}, run="r", step=1, metadata={"loss": 1.5})
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


def test_read_commands_json(shared):
    s = ("--store", str(shared))
    log, log_r, show, ls, diff, du, tags, pre = ck_many(
        (("log", "--json", *s), {}),
        (("log", "--run", "r", "-n", "1", "--json", *s), {}),
        (("show", "best", "--json", *s), {}),
        (("ls", "r@1", "m/", "--json", *s), {}),
        (("diff", "r@1", "best", "--numeric", "--json", *s), {}),
        (("du", "--json", *s), {}),
        (("tag", "--list", "--json", *s), {}),
        ((*s, "--json", "log"), {}),  # global options before the command work too
    )
    rows = ok_json(log)
    assert [(r["run"], r["step"]) for r in rows] == [("q", 5), ("r", 2), ("r", 1)]
    assert rows[1]["tags"] == ["best"] and rows[0]["new_bytes"] == 0 and rows[2]["metadata"] == {"loss": 1.5}
    assert [(r["run"], r["step"]) for r in ok_json(log_r)] == [("r", 2)]
    assert ok_json(pre) == rows
    d = ok_json(show)
    assert (d["run"], d["step"], d["tags"]) == ("r", 2, ["best"]) and d["stored_bytes"] > 0
    assert d["entries"] == {"tensors": 3, "values": 1} and d["parent_id"] == rows[2]["id"]
    entries = {e["key"]: e for e in ok_json(ls)}
    assert entries["m/w"] == {"key": "m/w", "kind": "tensor", "dtype": "float32", "shape": [10, 256], "bytes": 10240}
    assert entries["m/lr"]["kind"] == "value" and set(entries) == {"m/w", "m/b", "m/lr"}
    dd = ok_json(diff)
    assert dd["counts"] == {"added": 1, "removed": 0, "changed": 1, "unchanged": 2}
    w = next(k for k in dd["keys"] if k["key"] == "m/w")
    assert (w["changed_chunks"], w["total_chunks"]) == (1, 10) and w["numeric"]["max_abs_diff"] == pytest.approx(1.0)
    usage = ok_json(du)
    runs = {r["run"]: r for r in usage["runs"]}
    assert runs["r"]["snapshots"] == 2 and runs["q"]["snapshots"] == 1
    assert usage["total"]["snapshots"] == 3 and usage["total"]["pack_bytes"] >= usage["total"]["stored_bytes"]
    assert usage["total"]["logical_bytes"] == sum(r["logical_bytes"] for r in rows)
    _check_du_against_index(shared, runs, usage["total"])
    assert [(t["name"], t["run"], t["step"]) for t in ok_json(tags)] == [("best", "r", 2)]


def _check_du_against_index(path: Path, runs: dict, total: dict) -> None:
    with ckstore.open(path, create=False) as store:
        chunks: dict[str, set[str]] = {}
        for snap in store.log():
            chunks.setdefault(snap.run, set()).update(store.index.snapshot_chunk_ids(snap.id))
        everything = set().union(*chunks.values())
        locs = store.index.chunk_locations(everything)
    for run, ids in chunks.items():
        assert runs[run]["stored_bytes"] == sum(locs[i].length for i in ids)
        assert runs[run]["dedup_ratio"] == pytest.approx(runs[run]["logical_bytes"] / runs[run]["stored_bytes"])
    assert total["stored_bytes"] == sum(loc.length for loc in locs.values()) and total["chunks"] == len(everything)


def test_read_commands_human(shared):
    s = ("--store", str(shared))
    log, show, ls, diff, du, tags = ck_many(
        (("log", *s), {}), (("show", "r@1", *s), {}), (("ls", "best", *s), {}),
        (("diff", "r@1", "r@2", *s), {}), (("du", *s), {}), (("tag", *s), {}),
    )
    for p in (log, show, ls, diff, du, tags):
        assert p.returncode == 0 and p.stderr == "", p.stderr
    assert log.stdout.splitlines()[0].split() == ["id", "snapshot", "time", "logical", "new", "tags"]
    assert "r@2" in log.stdout and "best" in log.stdout and "KiB" in log.stdout
    assert "loss" in show.stdout and "run:" in show.stdout
    assert "m/extra" in ls.stdout and "float32" in ls.stdout and "4 entries" in ls.stdout
    assert "1/10 (10%)" in diff.stdout and "+  m/extra" in diff.stdout and "1 changed" in diff.stdout
    assert "(total)" in du.stdout and "packs on the backend" in du.stdout
    assert tags.stdout.split()[4] == "best"


def test_store_discovery_and_console_script(shared, tmp_path):
    exe = Path(sys.executable).parent / "ckstore"
    assert exe.exists(), "the console script is installed next to the interpreter"
    nowhere = tmp_path / "empty"
    nowhere.mkdir()
    by_cwd, by_env, script, missing, bad_store = ck_many(
        (("log", "--json"), {"cwd": shared / "sub" / "dir"}),
        (("log", "--json"), {"cwd": nowhere, "env": _env(CKSTORE_STORE=str(shared))}),
        (("show", "best", "--json"), {"cwd": shared, "exe": [str(exe)]}),
        (("log",), {"cwd": nowhere}),
        (("log", "--store", str(nowhere / "no-such-store")), {}),
    )
    assert len(ok_json(by_cwd)) == 3 and len(ok_json(by_env)) == 3
    assert ok_json(script)["step"] == 2
    one_error_line(missing, 3, "no ckstore store", "ckstore init")
    one_error_line(bad_store, 3, "no-such-store")


def test_errors_are_one_line_with_exit_codes(shared):
    s = ("--store", str(shared))
    unknown_ref, bad_tag, spaced_tag, unknown_cmd, no_key, tag_exists, bad_fraction, bad_duration = ck_many(
        (("show", "nope", *s), {}),
        (("tag", "r@1", "../x", *s), {}),
        (("tag", "r@1", "a b", *s), {}),
        (("frobnicate", *s), {}),
        (("ls", "r@1", "zzz", *s), {}),
        (("tag", "r@1", "best", *s), {}),
        (("check", "--read-data", "2", *s), {}),
        (("gc", "--older-than", "soon", *s), {}),
    )
    one_error_line(unknown_ref, 3, "'nope'")
    one_error_line(bad_tag, 2, "'../x'")
    one_error_line(spaced_tag, 2, "'a b'")
    one_error_line(unknown_cmd, 2, "frobnicate")
    one_error_line(no_key, 3, "zzz")
    one_error_line(tag_exists, 4, "best", "--force")
    one_error_line(bad_fraction, 2, "fraction")
    one_error_line(bad_duration, 2, "duration")


def test_tag_and_rm_change_the_store(scratch):
    s = ("--store", str(scratch))
    made = ok_json(ck("tag", "r@1", "first", "--json", *s))
    assert made["tag"] == "first" and made["step"] == 1
    moved, deleted = ck("tag", "r", "best", "--force", *s), ck("tag", "--delete", "first", "--json", *s)
    assert moved.returncode == 0 and "tagged r@2" in moved.stdout
    assert ok_json(deleted) == {"deleted": "first"}
    gone = ok_json(ck("rm", "r@1", "--json", *s))["deleted"]
    after, again, untag = ck_many(
        (("log", "--json", *s), {}), (("rm", "r@1", *s), {}), (("tag", "--delete", "first", *s), {})
    )
    assert gone[0] not in {r["id"] for r in ok_json(after)} and len(ok_json(after)) == 2
    one_error_line(again, 3, "r@1")
    one_error_line(untag, 3, "first")


def test_init(tmp_path):
    target = tmp_path / "new"
    made = ok_json(ck("init", str(target), "--chunk-bytes", "2KiB", "--pack-bytes", "16KiB", "--json"))
    assert (made["chunk_bytes"], made["pack_bytes"]) == (2048, 16384)
    assert (target / "ckstore.json").is_file()
    here = tmp_path / "here"
    here.mkdir()
    again, in_cwd, bad = ck_many(
        (("init", str(target)), {}), (("init",), {"cwd": here}), (("init", str(tmp_path / "x"), "--chunk-bytes", "lots"), {})
    )
    one_error_line(again, 4, "already exists")
    assert in_cwd.returncode == 0 and "initialized empty ckstore store" in in_cwd.stdout
    assert (here / "ckstore.json").is_file()
    one_error_line(bad, 2, "not a size")
    with ckstore.open(target, create=False) as store:
        assert store.config.chunk_bytes == 2048 and store.log() == []


def test_gc_and_check_run_against_the_store(scratch):
    """Needs store.gc (ckstore/_gc.py) and store.check (ckstore/_check.py)."""
    s = ("--store", str(scratch))
    dry, check, read = ck_many(
        (("gc", "--dry-run", "--keep-last", "1", "--json", *s), {}),
        (("check", "--json", *s), {}),
        (("check", "--read-data", "--json", *s), {}),
    )
    assert isinstance(ok_json(dry), dict)
    assert ok_json(check)["ok"] is True and ok_json(read)["ok"] is True
    human = ck("gc", "--dry-run", *s)
    assert human.returncode == 0 and human.stdout.strip()
    with ckstore.open(scratch, create=False) as store:
        assert len(store.log()) == 3  # a dry run deletes nothing


# --- in-process: argument mapping and help (no subprocess needed) ------------------------------
def _args(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_gc_arguments_map_to_store_gc():
    a = _args("gc", "--keep-last", "3", "--keep-every-steps", "1000", "--older-than", "7d", "--run", "sft",
              "--run", "rl", "--no-keep-tagged", "--grace", "12h", "--dry-run")
    assert cli.gc_policy(a) == {
        "keep_last": 3, "keep_every_steps": 1000, "older_than": 7 * 86400.0, "runs": ["sft", "rl"],
        "keep_tagged": False, "grace_seconds": 12 * 3600.0, "dry_run": True,
    }
    assert cli.gc_policy(_args("gc")) == {"dry_run": False, "keep_tagged": True}
    assert _args("check").read_data is False
    assert _args("check", "--read-data").read_data is True
    assert _args("check", "--read-data", "0.25").read_data == 0.25


class _Report:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def to_dict(self):
        return {"ok": self.ok, "problems": [] if self.ok else [{"pack": "ab12", "error": "bad"}], "checked_bytes": 4096}


def test_gc_and_check_call_the_store(shared, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(ckstore.Store, "gc", lambda self, **kw: seen.setdefault("gc", kw) and _Report(True))
    monkeypatch.setattr(ckstore.Store, "check", lambda self, read_data=False: seen.setdefault("check", read_data) is not None and _Report(read_data != 0.5))
    assert cli.main(["--store", str(shared), "gc", "--keep-last", "2", "--older-than", "90m", "--json"]) == 0
    assert seen["gc"] == {"keep_last": 2, "older_than": 5400.0, "dry_run": False, "keep_tagged": True}
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli.main(["--store", str(shared), "check", "--read-data", "0.5"]) == 1
    assert seen["check"] == 0.5
    out = capsys.readouterr().out
    assert "ok: False" in out and "checked_bytes: 4.0 KiB" in out


def test_help_everywhere(capsys):
    for argv in [["--help"]] + [[name, "--help"] for name, *_ in cli.COMMANDS]:
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
