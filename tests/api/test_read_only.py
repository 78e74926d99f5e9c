"""Read-only stores (issue 27, item 5): every read works, every write is refused by name.

Published checkpoints live on read-only media (an NFS export, a container image layer, a
mounted bucket). The tests run as root, which ignores permission bits, so "not writable" is
made real in three ways: ``read_only=True`` / ``--read-only``, SQLite ``mode=ro`` and
``immutable=1`` index URLs (SQLite enforces those whoever runs it), and a real read-only bind
mount inside a user namespace (``unshare -rm``), skipped where the kernel does not allow one.
The detection itself (``os.access``) is also checked with a patched ``os.access``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from ckstore.errors import InvalidInputError, ReadOnlyStoreError
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _state(seed: int) -> dict[str, ckstore.StateDict]:
    torch.manual_seed(seed)
    return {"m": ckstore.StateDict(w=torch.randn(16, 64), step=seed)}


@pytest.fixture
def published(tmp_path: Path) -> Path:
    path = tmp_path / "published"
    with ckstore.open(path, create=True, **TINY) as store:
        store.take(_state(1), run="r", step=1)
        store.take(_state(2), run="r", step=2, tags=["best"])
    return path


def _fingerprint(path: Path) -> dict[str, str]:
    """Every file's hash, SQLite's ``-wal`` and ``-shm`` included: a read-only open leaves
    none behind."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _reads_work(store: ckstore.Store, tmp_path: Path) -> None:
    assert store.read_only
    assert [s.step for s in store.log()] == [2, 1] and store.tags() == {"best": store.get("r").id}
    dest = _state(0)
    store.get("best").restore(dest)
    assert torch.equal(dest["m"]["w"], _state(2)["m"]["w"]) and dest["m"]["step"] == 2
    assert torch.equal(store.get("r@1").read_object("m/w"), _state(1)["m"]["w"])
    assert store.diff("r@1", "r@2").counts["changed"] == 2
    assert store.check(read_data=True).ok
    assert store.gc(keep_last=1, dry_run=True).snapshots_dropped  # a dry run only reads
    store.get("best").export(tmp_path / "out", "torch")
    assert (tmp_path / "out").is_dir()


def _writes_are_refused(store: ckstore.Store) -> None:
    writes = [
        lambda: store.take(_state(3), run="r", step=3),
        lambda: store.tag("r@1", "first"),
        lambda: store.untag("best"),
        lambda: store.delete("r@1", force=True),
        lambda: store.gc(keep_last=1),
    ]
    for write in writes:
        with pytest.raises(ReadOnlyStoreError, match="read-only") as exc:
            write()
        assert isinstance(exc.value, PermissionError)


def test_read_only_true_serves_reads_and_refuses_writes_without_writing(
    published, tmp_path
) -> None:
    before = _fingerprint(published)
    with ckstore.open(published, read_only=True) as store:
        _reads_work(store, tmp_path)
        _writes_are_refused(store)
    assert _fingerprint(published) == before  # not even the WAL switch or store_id metadata
    with pytest.raises(InvalidInputError, match="read-only"):
        ckstore.open(tmp_path / "new", create=True, read_only=True)


@pytest.mark.parametrize("query", ["mode=ro", "immutable=1"])
def test_sqlite_read_only_urls_open(published, tmp_path, query) -> None:
    url = f"sqlite:///file:{published / 'index.sqlite'}?{query}&uri=true"
    before = _fingerprint(published)
    with ckstore.open(published, index=url) as store:
        _reads_work(store, tmp_path)
        with pytest.raises(ReadOnlyStoreError, match="URL opens it read-only"):
            store.tag("r@1", "first")
    assert _fingerprint(published) == before


def test_a_store_that_is_not_writable_opens_read_only(published, tmp_path, monkeypatch) -> None:
    real = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and str(path).startswith(str(published)):
            return False  # as on a read-only mount, where even root gets EROFS
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    with ckstore.open(published) as store:
        _reads_work(store, tmp_path)
        with pytest.raises(ReadOnlyStoreError, match="not writable"):
            store.tag("r@1", "first")
    with ckstore.open(published, read_only=False) as store:  # insisting: writable after all
        assert not store.read_only


def test_cli_read_only_flag(published, capsys) -> None:
    s = ("--store", str(published), "--read-only")
    assert cli.main(["log", *s]) == 0
    assert "r@2" in capsys.readouterr().out
    assert cli.main(["tag", "r@1", "first", *s]) == 6
    err = capsys.readouterr().err
    assert err.startswith("ckstore: error: cannot tag 'first'") and "read-only" in err


def _can_mount_read_only(tmp_path: Path) -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        [unshare, "-rm", "sh", "-c", f"mount --bind -o ro {probe} {probe} && ! touch {probe}/x"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    return done.returncode == 0


def test_a_real_read_only_mount(published, tmp_path) -> None:
    """Log, show, check, export and a restore in a fresh process behind a read-only bind mount."""
    if not _can_mount_read_only(tmp_path):
        pytest.skip("no user namespaces with read-only bind mounts here")
    out = tmp_path / "exported"
    script = f"""
import sys, torch, ckstore
from ckstore import cli
s = ["--store", {str(published)!r}]
codes = [cli.main(["log", *s]), cli.main(["show", "best", *s]), cli.main(["check", "--read-data", *s]),
         cli.main(["du", *s]), cli.main(["export", "best", {str(out)!r}, "--format", "torch", *s])]
print("CODES", codes)
print("TAG", cli.main(["tag", "r@1", "first", *s]))
store = ckstore.open({str(published)!r})
dest = {{"m": ckstore.StateDict(w=torch.zeros(16, 64), step=0)}}
store.get("best").restore(dest)
print("RESTORED", dest["m"]["step"], store.read_only)
"""
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         'mount --bind -o ro "$0" "$0" && exec "$1" -c "$2"', str(published), sys.executable, script],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CODES [0, 0, 0, 0, 0]" in done.stdout, done.stdout + done.stderr
    assert "TAG 6" in done.stdout and "is not writable" in done.stderr
    assert "RESTORED 2 True" in done.stdout
    assert "Traceback" not in done.stderr
    assert (out / "checkpoint.pt").is_file()


@pytest.mark.postgres
def test_read_only_postgres_index(pg, tmp_path) -> None:
    url = pg.new_database()
    with ckstore.open(tmp_path / "s", index=url, create=True, **TINY) as store:
        store.take(_state(1), run="r", step=1)
    with ckstore.open(tmp_path / "s", index=url, read_only=True) as store:
        assert [s.step for s in store.log()] == [1]
        with pytest.raises(ReadOnlyStoreError):
            store.tag("r@1", "best")


# --- issue 31, item 8 --------------------------------------------------------------------------
def _can_be_another_user(tmp_path: Path) -> bool:
    """Whether ``unshare --user --map-user=1000`` runs here (a user that is not root: the
    permission bits apply to it, unlike to the root the tests run as)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = tmp_path / "probe-user"
    probe.mkdir()
    probe.chmod(0o555)
    done = subprocess.run(
        [unshare, "--user", "--map-user=1000", "sh", "-c", f"! touch {probe}/x 2>/dev/null"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    return done.returncode == 0


def _as_another_user(script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != cli.STORE_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        ["unshare", "--user", "--map-user=1000", sys.executable, "-c", script],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


def test_a_store_in_a_folder_the_user_cannot_write_opens_read_only(published, tmp_path) -> None:
    """Before: ReadOnlyStoreError "attempt to write a readonly database" (the WAL's -shm cannot
    be made, and the immutable fallback caught only the untranslated error)."""
    if not _can_be_another_user(tmp_path):
        pytest.skip("no user namespaces here")
    for p in [published, *published.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    before = _fingerprint(published)
    script = f"""
import torch, ckstore
from ckstore import cli
from ckstore.errors import ReadOnlyStoreError
store = ckstore.open({str(published)!r})
print("READ_ONLY", store.read_only, [s.step for s in store.log()])
dest = {{"m": ckstore.StateDict(w=torch.zeros(16, 64), step=0)}}
store.get("best").restore(dest)
print("RESTORED", dest["m"]["step"], store.check(read_data=True).ok)
try:
    store.tag("r@1", "first")
except ReadOnlyStoreError as exc:
    print("REFUSED", exc)
store.close()
print("LOG", cli.main(["--store", {str(published)!r}, "log"]))
"""
    done = _as_another_user(script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "READ_ONLY True [2, 1]" in done.stdout and "RESTORED 2 True" in done.stdout
    assert "REFUSED" in done.stdout and "not writable" in done.stdout
    assert "LOG 0" in done.stdout
    assert _fingerprint(published) == before


@pytest.mark.parametrize("how", ["read_only=True", "mode=ro", "not writable"])
def test_opening_read_only_leaves_no_wal_or_shm_in_a_writable_folder(
    published, tmp_path, monkeypatch, how
) -> None:
    """Before: a mode=ro reader made ``index.sqlite-wal`` and ``-shm`` and left them."""
    before = _fingerprint(published)
    assert not [n for n in before if n.endswith(("-wal", "-shm"))]
    kwargs: dict = {"read_only": True}
    if how == "mode=ro":
        kwargs = {"index": f"sqlite:///file:{published / 'index.sqlite'}?mode=ro&uri=true"}
    elif how == "not writable":
        real = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, m, *a, **k: False if m & os.W_OK else real(p, m, *a, **k),
        )
        kwargs = {}
    with ckstore.open(published, **kwargs) as store:
        _reads_work(store, tmp_path)
    assert _fingerprint(published) == before


def test_a_read_only_reader_beside_a_writer_sees_its_commits_and_leaves_its_fingerprint(
    published,
) -> None:
    with ckstore.open(published) as writer:
        writer.take(_state(3), run="r", step=3)  # the writer's -wal and -shm exist now
        with ckstore.open(published, read_only=True) as reader:
            assert [s.step for s in reader.log()] == [3, 2, 1]
            writer.take(_state(4), run="r", step=4)
            assert [s.step for s in reader.log()] == [4, 3, 2, 1]  # not a frozen view
        writer.take(_state(5), run="r", step=5)  # its files are still its own
        assert (published / "index.sqlite-wal").exists()
    with ckstore.open(published) as again:
        assert [s.step for s in again.log()] == [5, 4, 3, 2, 1]
    assert not list(published.glob("index.sqlite-*"))  # the last one out removed them


def test_hydrate_on_a_read_only_store_refuses_before_writing(tmp_path) -> None:
    from tests.support.remotes import fill_evicted

    local = tmp_path / "local"
    fill_evicted(local, tmp_path / "remote")
    before = _fingerprint(local)
    with ckstore.open(local, read_only=True) as store:
        with pytest.raises(ReadOnlyStoreError, match="cannot hydrate"):
            store.hydrate()  # before: wrote a pack, then failed on recording it
    assert _fingerprint(local) == before


def test_a_push_from_a_read_only_store_sends_everything_and_records_nothing(
    published, tmp_path
) -> None:
    with ckstore.open(published) as store:
        store.add_remote("origin", str(tmp_path / "remote"))
    before = _fingerprint(published)
    with ckstore.open(published, read_only=True) as store:
        report = store.push("origin")  # before: sent one snapshot, then failed recording it
        assert len(report.snapshots_sent) == 2
        assert {s.state for s in store.push_status().values()} == {"local"}
    assert _fingerprint(published) == before
    with ckstore.open(tmp_path / "remote") as theirs:
        assert [s.step for s in theirs.log()] == [2, 1] and "best" in theirs.tags()


def test_migrate_read_only_refuses_instead_of_upgrading(tmp_path, capsys) -> None:
    from tests.index import fixture_data_0003 as frozen

    old = tmp_path / "old.sqlite"
    shutil.copyfile(frozen.FILE, old)
    digest = hashlib.sha256(old.read_bytes()).hexdigest()
    url = f"sqlite:///{old}"
    assert cli.main(["--read-only", "migrate", "--index", url]) == 6
    assert "read-only" in capsys.readouterr().err
    ro = f"sqlite:///file:{old}?mode=ro&uri=true"
    assert cli.main(["migrate", "--index", ro]) == 6
    assert hashlib.sha256(old.read_bytes()).hexdigest() == digest  # before: upgraded in place
    assert cli.main(["migrate", "--index", url]) == 0  # asked without it: upgraded
