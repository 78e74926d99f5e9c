"""What a remote is made of: no credentials kept in the index, a path that can never hold a store
refused at once, and a copy of a store told from the store itself by its place."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

import ckstore
from ckstore import errors
from tests.support.cli import run
from tests.support.remotes import KNOBS, fill, restores, same_history


def _index_text(store_dir: Path) -> str:
    """Every remote row of the store's SQLite index, as text."""
    with sqlite3.connect(store_dir / "index.sqlite") as conn:
        return json.dumps(conn.execute("SELECT * FROM remotes").fetchall())


def test_credentials_in_remote_options_are_refused_with_how_to_pass_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s"
    with ckstore.open(path, create=True) as store:
        for options in (
            {"key": "AKIA1", "secret": "s3cr3t"},
            {"client_kwargs": {"aws_secret_access_key": "s3cr3t"}},
            {"token": "t0k3n"},
            {"password": "pw"},
        ):
            with pytest.raises(errors.InvalidInputError, match="AWS_SECRET_ACCESS_KEY") as err:
                store.add_remote("origin", "s3://b/p", storage_options=options)
            assert "s3cr3t" not in str(err.value) and "credentials" in str(err.value)
        assert store.remotes() == []
        store.add_remote(
            "origin",
            "s3://b/p",
            storage_options={"anon": False, "client_kwargs": {"endpoint_url": "http://x"}},
        )
    code, _, err = run(
        capsys, "--store", str(path), "remote", "add", "other", "s3://b/q", "-o", "secret=s3cr3t"
    )
    assert code != 0 and "secret" in err and "AWS_SECRET_ACCESS_KEY" in err
    assert "s3cr3t" not in _index_text(path) and "other" not in _index_text(path)


def test_credentials_given_to_push_to_serve_the_process_and_are_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remote_options`` of ``ckstore.open(..., push_to=URL)`` reach the remote's filesystem
    for this process; the remote recorded keeps the rest of them, not the credentials."""
    import ckstore.remote.config as config

    seen: list[dict[str, object]] = []
    real = config.open_repository

    def spying(url, **kw):  # type: ignore[no-untyped-def]
        seen.append(dict(kw.get("storage_options") or {}))
        return real(url, **kw)

    monkeypatch.setattr(config, "open_repository", spying)
    with ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(tmp_path / "remote"),
        remote_options={"auto_mkdir": True, "token": "t0k3n"},
        **KNOBS,
    ) as store:
        fill(store, "r", [1])
        assert store.wait_pushed(timeout=60)
    assert {"auto_mkdir": True, "token": "t0k3n"} in seen
    text = _index_text(tmp_path / "local")
    assert "t0k3n" not in text and "auto_mkdir" in text


def test_clone_keeps_no_credentials(tmp_path: Path, source: ckstore.Store) -> None:
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.clone(
        tmp_path / "remote", tmp_path / "copy", storage_options={"password": "pw"}
    ) as copy:
        assert [r.options for r in copy.remotes()] == [{}]
        assert restores(copy, "r@3", 3)
    assert "pw" not in _index_text(tmp_path / "copy")


@pytest.mark.parametrize("how", ["file", "below a file"])
def test_a_push_to_that_can_never_work_is_refused_at_once(tmp_path: Path, how: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = blocker if how == "file" else blocker / "ckpts"
    with pytest.raises(errors.InvalidInputError, match="no store can ever be there"):
        ckstore.open(tmp_path / "local", create=True, push_to=str(target))
    with ckstore.open(tmp_path / "local") as store:
        assert store.remotes() == []
        with pytest.raises(errors.InvalidInputError, match=str(blocker)):
            store.add_remote("backup", target)


def test_a_copy_of_a_store_is_a_remote_like_any_other(
    tmp_path: Path, source: ckstore.Store
) -> None:
    """``cp -r`` of this store has its id but is another store: it takes pushes (only what it
    lacks) and gives pulls; this store itself, by any path to it, is refused naming both."""
    shutil.copytree(source.url, tmp_path / "copy")
    fill(source, "r", [4])
    source.add_remote("copy", tmp_path / "copy")
    report = source.push("copy")
    assert [s.split(" ")[0] for s in report.snapshots_sent] == [
        "r@4"
    ] and report.snapshots_present == 4
    with ckstore.open(tmp_path / "copy") as copy:
        assert same_history(source, copy) and restores(copy, "r@4", 4)
    os.symlink(source.url, tmp_path / "link")
    source.add_remote("me", tmp_path / "link")
    with pytest.raises(errors.InvalidInputError, match="is this store itself") as err:
        source.push("me")
    assert str(tmp_path / "link") in str(err.value) and source.url in str(err.value)


def test_two_stores_in_memory_are_two_stores() -> None:
    """Both have the index URL ``sqlite:///:memory:``, and share nothing."""
    from ckstore.remote.transfer import same_store

    with ckstore.open("memory://", create=True) as a, ckstore.open("memory://", create=True) as b:
        assert not same_store(a.repository, b.repository)
        assert same_store(a.repository, a.repository)
