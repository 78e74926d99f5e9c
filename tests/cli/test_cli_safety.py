"""Nothing destructive by surprise, and a command line that finds things.

The demo never writes into or deletes a store it did not make; ``rm`` of a tagged snapshot
needs ``--force`` (``Store.delete`` needs ``force=True``); gc says what its grace period kept
and until when; a failed ``init`` leaves nothing behind; a missing store or PostgreSQL
database gets an error that says what to do; remote stores take ``--storage-option``.

Most calls run the CLI in this process (``cli.main``); the few subprocesses are the ones that
must be a real executable (the demo, S3 through the command line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.cli._setup import DEMO_MARK, DEMO_STORE, claim_demo_store
from ckstore.errors import ConflictError, InvalidInputError
from tests.support.cli import run
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture(autouse=True)
def _no_store_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.STORE_ENV, raising=False)


def error_line(result: tuple[int, str, str], code: int, *words: str) -> str:
    got, out, err = result
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckstore: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _state(seed: int) -> dict[str, ckstore.StateDict]:
    torch.manual_seed(seed)
    return {"m": ckstore.StateDict(w=torch.randn(8, 256), step=seed)}


def _store(path: Path, steps: int = 3, tag_first: str | None = None) -> None:
    with ckstore.open(path, **TINY, create=True) as store:
        for step in range(1, steps + 1):
            tags = [tag_first] if tag_first and step == 1 else []
            store.take(_state(step), run="r", step=step, tags=tags)


def _listing(path: Path) -> dict[str, int]:
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


# --- demo -----------------------------------------------------------------------------------
def test_demo_refuses_a_store_it_did_not_make(tmp_path: Path, capsys) -> None:
    mine = tmp_path / "ck"
    _store(mine, steps=1)
    before = _listing(mine)
    line = error_line(run(capsys, "--store", str(mine), "demo"), 4, str(mine), "did not create")
    assert "--store" in line
    assert _listing(mine) == before  # not a byte written, nothing deleted
    with ckstore.open(mine, create=False) as store:
        assert [s.step for s in store.log()] == [1]

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    error_line(run(capsys, "--store", str(other), "demo"), 4, str(other), "not empty")
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
    error_line(run(capsys, "--store", "memory://x", "demo"), 2, "local folder")


def test_demo_replaces_only_its_own_store(tmp_path: Path) -> None:
    path = tmp_path / "demo"
    assert claim_demo_store(str(path)) == str(path)  # a new folder: made and marked
    assert (path / DEMO_MARK).is_file() and (path / "ckstore.json").is_file()
    with ckstore.open(path, create=False) as store:
        store.take(_state(1), run="demo", step=1)
    claim_demo_store(str(path))  # its own store, only the demo's run: replaced by an empty one
    with ckstore.open(path, create=False) as store:
        assert store.log() == []
        store.take(_state(1), run="mine", step=1)
    with pytest.raises(ConflictError, match="mine"):
        claim_demo_store(str(path))  # someone used it for their own run: left alone
    with ckstore.open(path, create=False) as store:
        assert store.runs() == ["mine"]
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_demo_store(str(empty))  # an empty folder is fine
    with pytest.raises(InvalidInputError):
        claim_demo_store("s3://bucket/demo")


def test_demo_help_names_its_own_default_store(capsys) -> None:
    code, out, _ = run(capsys, "demo", "--help")
    text = "".join(out.split())  # argparse wraps lines, also at hyphens
    assert code == 0 and f"default:{DEMO_STORE}" in text and "$CKSTORE_STOREisnotused" in text
    assert "neareststoreupwards" not in text  # the other commands' default does not apply


def test_demo_runs_in_its_claimed_folder(tmp_path: Path) -> None:
    """The whole demo, shortened, in a store an earlier demo made (so it is replaced)."""
    path = tmp_path / "demo-store"
    claim_demo_store(str(path))
    with ckstore.open(path, create=False) as store:
        store.take(_state(1), run="demo", step=99)
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(path), "demo", "--steps", "4", "--every", "2"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "loss curves bit-identical: True" in p.stdout
    with ckstore.open(path, create=False) as store:
        assert [s.step for s in store.log()] == [2]  # step 99 went with the old demo store


# --- rm -------------------------------------------------------------------------------------
def test_store_delete_of_a_tagged_snapshot_needs_force(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", **TINY, create=True) as store:
        a = store.take(_state(1), run="r", step=1, tags=["best", "v1"])
        with pytest.raises(ConflictError, match=r"tagged best, v1.*force=True"):
            store.delete("best")
        assert store.get("r@1").id == a.id and store.tags() == {"best": a.id, "v1": a.id}
        store.delete("best", force=True)
        assert store.log() == [] and store.tags() == {}
        store.take(_state(2), run="r", step=2)
        store.delete("r@2")  # untagged: no force needed


def test_rm_of_a_tagged_snapshot_needs_force(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s"
    _store(path, steps=3, tag_first="best")
    s = ("--store", str(path))
    line = error_line(run(capsys, "rm", "r@3", "r@1", *s), 4, "r@1", "best", "--force")
    assert "r@3" not in line
    with ckstore.open(path, create=False) as store:
        assert len(store.log()) == 3  # refused before deleting any
    code, out, _ = run(capsys, "rm", "r@2", *s)
    assert code == 0 and "deleted snapshot r@2" in out
    code, out, _ = run(capsys, "rm", "r@1", "--force", "--json", *s)
    assert code == 0 and json.loads(out)["tags_deleted"] == ["best"]
    with ckstore.open(path, create=False) as store:
        assert [x.step for x in store.log()] == [3] and store.tags() == {}


# --- gc -------------------------------------------------------------------------------------
def test_gc_reports_what_the_grace_period_kept(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s"
    _store(path, steps=4)
    s = ("--store", str(path))
    with ckstore.open(path, create=False) as store:
        dry = store.gc(keep_last=1, dry_run=True)
        assert dry.grace_kept_bytes > 0 and dry.grace_kept_chunks > 0
        t0 = time.time()
        report = store.gc(keep_last=1)  # the default 6 h grace period: young data stays
    assert len(report.snapshots_dropped) == 3 and report.bytes_reclaimed == 0
    assert report.grace_kept_bytes == dry.grace_kept_bytes and report.grace_kept_chunks > 0
    assert report.grace_seconds == 6 * 3600
    assert t0 - 60 + 6 * 3600 < report.grace_expires_at < time.time() + 6 * 3600

    code, out, _ = run(capsys, "gc", *s)
    assert code == 0 and "grace_seconds: 6h" in out
    assert "grace_kept_bytes: " in out and "grace_expires_at: 20" in out
    assert "note: the 6h grace period kept" in out and "--grace 0s" in out
    code, out, _ = run(capsys, "gc", "--json", *s)
    d = json.loads(out)
    assert d["grace_kept_bytes"] == report.grace_kept_bytes and d["grace_expires_at"] > t0
    assert "note:" not in out

    time.sleep(0.3)  # older than a 0.2 s grace: chunks go, their emptied packs are retired...
    with ckstore.open(path, create=False) as store:
        report = store.gc(grace_seconds=0.2)
    assert report.chunks_removed > 0 and report.packs_retired > 0 and report.packs_removed == 0
    assert report.grace_kept_chunks == 0 and report.grace_kept_packs == report.packs_retired
    assert report.grace_kept_bytes > 0 and report.grace_expires_at < time.time() + 0.2
    code, out, _ = run(capsys, "gc", "--grace", "0s", *s)  # ...and deleted past the grace
    assert code == 0 and "grace_kept_bytes: 0 B" in out and "grace_expires_at: -" in out
    assert "note:" not in out


# --- init -----------------------------------------------------------------------------------
def test_a_failed_init_leaves_nothing_behind(tmp_path: Path, capsys) -> None:
    new = tmp_path / "a" / "new"
    error_line(run(capsys, "init", str(new), "--index", "nosuchdb://x/y"), 2, "nosuchdb")
    assert not (tmp_path / "a").exists()
    bad_sqlite = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'i.sqlite'}"
    error_line(run(capsys, "init", str(new), "--index", bad_sqlite), 6, "open index")
    assert not (tmp_path / "a").exists() and not (tmp_path / "no").exists()
    there = tmp_path / "there"
    there.mkdir()
    (there / "keep.txt").write_text("mine")
    # a non-empty folder that is not a store is refused by name (issue 27, item 7)
    error_line(run(capsys, "init", str(there), "--index", bad_sqlite), 4, "not empty", "keep.txt")
    assert [p.name for p in there.iterdir()] == ["keep.txt"]  # what was there stays
    code, out, _ = run(capsys, "init", str(new))  # and init then works, with no "exists"
    assert code == 0 and "initialized empty ckstore store" in out
    error_line(run(capsys, "init", str(there / "keep.txt")), 2, "is a file")


@pytest.mark.postgres
def test_init_with_a_missing_postgres_database_says_how_to_create_it(pg, tmp_path, capsys):
    url = pg.url(f"nope_{uuid.uuid4().hex[:8]}")
    new = tmp_path / "s"
    line = error_line(run(capsys, "init", str(new), "--index", url), 3, "does not exist")
    assert f"createdb -h 127.0.0.1 -p {pg.port} -U postgres nope_" in line
    assert "CREATE DATABASE" in line and not new.exists()


# --- finding stores -------------------------------------------------------------------------
def test_no_store_found_says_where_it_looked(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "init", "./ckpts")[0] == 0
    line = error_line(run(capsys, "log"), 3, str(tmp_path), "--store", cli.STORE_ENV)
    assert "ckpts/ here holds a store: pass --store ckpts" in line
    code, out, _ = run(capsys, "--store", "ckpts", "log", "--json")
    assert code == 0 and json.loads(out) == []
    assert run(capsys, "init", "./other")[0] == 0  # two stores below: no guess
    line = error_line(run(capsys, "log"), 3, "--store")
    assert "holds a store" not in line


def test_version(capsys) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"ckstore {ckstore.__version__}"


# --- remote stores --------------------------------------------------------------------------
def test_storage_options_nest_and_parse_json() -> None:
    args = cli.build_parser().parse_args(
        [
            "-o", "key=k",
            "--storage-option", "client_kwargs.endpoint_url=http://127.0.0.1:9000",
            "log",
            "-o", "config_kwargs.retries={\"max_attempts\": 3}",
            "-o", "anon=false",
            "-o", "client_kwargs.verify=\"no\"",
        ]
    )  # fmt: skip
    assert cli.storage_options(args) == {
        "key": "k",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "verify": "no"},
        "config_kwargs": {"retries": {"max_attempts": 3}},
        "anon": False,
    }
    clash = cli.build_parser().parse_args(["log", "-o", "a=1", "-o", "a.b=2"])
    with pytest.raises(InvalidInputError, match="a.b"):
        cli.storage_options(clash)
    assert cli.storage_options(cli.build_parser().parse_args(["log"])) == {}


def test_storage_option_without_equals_is_a_usage_error(capsys) -> None:
    error_line(run(capsys, "log", "-o", "endpoint"), 2, "KEY=VALUE")


def ck(*argv: str) -> tuple[int, str, str]:
    """Run the CLI as a real executable (no torch import on the read path: about 0.5 s)."""
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", *argv],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    return p.returncode, p.stdout, p.stderr


@pytest.mark.s3
def test_s3_store_from_the_command_line(s3_server, tmp_path: Path) -> None:
    bucket = f"cli-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    url, index = f"s3://{bucket}/ckpts", f"sqlite:///{tmp_path / 'index.sqlite'}"
    opts = (
        "-o", "key=testing", "-o", "secret=testing",
        "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
    )  # fmt: skip
    bad = f"sqlite:///{tmp_path / 'missing' / 'index.sqlite'}"
    error_line(ck("init", url, "--index", bad, *opts), 6)  # leaves nothing in the bucket...
    code, out, err = ck("init", url, "--index", index, *opts, "--json")  # ...so this works
    assert code == 0 and json.loads(out)["url"] == url, err
    error_line(ck("init", url, "--index", index, *opts), 4, "already exists")
    with ckstore.open(
        url, index=index, storage_options=s3_server.storage_options(), create=True
    ) as store:
        store.take(_state(1), run="r", step=1, tags=["best"])
        store.take(_state(2), run="r", step=2)
    s = ("--store", url, "--index", index, *opts)
    code, out, err = ck("log", "--json", *s)
    assert code == 0 and [r["step"] for r in json.loads(out)] == [2, 1], err
    code, out, err = ck("check", "--read-data", *s)
    assert code == 0 and "ok: True" in out, err
    code, out, err = ck(*opts, "--store", url, "--index", index, "diff", "r@1", "r@2")
    assert code == 0 and "2 changed" in out, err  # options before the command work too


def testreport_lines_format_durations_and_times() -> None:
    from ckstore.cli._common import report_lines

    lines = report_lines({"grace_seconds": 5400.0, "x_at": None, "done_at": 0.0}, "")
    assert lines[0] == "grace_seconds: 90m" and lines[1] == "x_at: -"
    assert lines[2].startswith("done_at: 19")
