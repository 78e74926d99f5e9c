"""Manifests a gc deletes while a push sends the same snapshot again, when something fails or
another gc runs beside: each test failed before its fix (``history.gc._delete_manifests``,
``remote.transfer._manifest_kept``)."""

from __future__ import annotations

import importlib
import threading

import pytest

import ckstore
from ckstore.errors import StorageError
from tests.support.manifest_races import killed_push, pushed_yesterday
from tests.support.remotes import KNOBS, fill, restores

transfer = importlib.import_module("ckstore.remote.transfer")


def test_a_gc_whose_read_fails_midway_leaves_a_deleted_manifest_a_row_names(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc reads and deletes manifest X, then the read of the next one fails (a timeout): it
    stops before its index check, so X, which a push committed meanwhile, is never put back."""
    from ckstore.objects.store import ObjectStore

    src, remote = pushed_yesterday(tmp_path, [1, 2, 3])
    s2, s3 = src.get("r@2"), src.get("r@3")
    remote.delete(s2.id)
    remote.delete(s3.id)

    real = ObjectStore.blob_bytes
    calls: list[str] = []

    def blob_bytes(self, kind, blob_id):
        calls.append(blob_id)
        if len(calls) == 1:  # the push runs through whole before the gc reads the first
            src.push("origin")  # (found in place, committed, still there: nothing to put back)
        if len(calls) == 2:
            raise StorageError("store: no answer within 30 s")  # a transient read failure
        return real(self, kind, blob_id)

    monkeypatch.setattr(ObjectStore, "blob_bytes", blob_bytes)
    with pytest.raises(StorageError):
        remote.gc()
    monkeypatch.setattr(ObjectStore, "blob_bytes", real)
    remote.close()
    with ckstore.open(tmp_path / "remote") as again:
        assert {s2.id, s3.id} <= {s.id for s in again.log()}  # both committed there
        assert again.check().ok, again.check().problems
        assert restores(again, s2.id, 2) and restores(again, s3.id, 3)
    src.close()


def test_two_orphan_sweeps_and_a_retried_push_lose_the_manifest_the_push_wrote(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed push leaves manifest X an orphan. Two gcs of the remote (a job's retention, a
    cron's gc) both list it while no session is alive. The first deletes it; the retried push
    then finds it gone and writes it (store_blob says: written, so no check after the commit);
    the second gc reads and deletes the push's copy and checks the index before the push
    commits. The push commits a snapshot whose manifest is gone."""
    from ckstore.index.maintenance import Maintenance
    from ckstore.objects.store import ObjectStore

    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", [1])
    src.add_remote("origin", tmp_path / "remote")
    snap = src.get("r@1")

    killed_push(src, monkeypatch)

    gc_a = ckstore.open(tmp_path / "remote")
    gc_b = ckstore.open(tmp_path / "remote")
    b_thread: list[threading.Thread] = []
    may_read = threading.Event()  # gc B: go on to read and delete (the push has put X)
    checked = threading.Event()  # gc B: has checked the index after its delete
    real_bytes = ObjectStore.blob_bytes
    real_ids = Maintenance.index_manifest_ids

    def blob_bytes(self, kind, blob_id):
        if threading.current_thread() in b_thread:
            assert may_read.wait(60)
        return real_bytes(self, kind, blob_id)

    def ids(self, among=None):
        known = real_ids(self, among)
        if among is not None and threading.current_thread() in b_thread:
            checked.set()
        return known

    monkeypatch.setattr(ObjectStore, "blob_bytes", blob_bytes)
    monkeypatch.setattr(Maintenance, "index_manifest_ids", ids)
    errors: list[BaseException] = []

    def run_b():
        try:
            gc_b.gc(grace_seconds=0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            checked.set()

    t = threading.Thread(target=run_b)
    b_thread.append(t)
    t.start()  # gc B lists X (no session alive), then waits before reading it
    import time

    for _ in range(600):  # until B is past its listing and its live-session check
        if not t.is_alive():
            break
        frame = __import__("sys")._current_frames().get(t.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "_delete_manifests" in names and "blob_bytes" in names:
            break
        time.sleep(0.05)
    gc_a.gc(grace_seconds=0)  # gc A deletes the orphan X (and the orphan packs)

    real_confirm = transfer.confirm

    def confirm(dst, name):  # after the manifest put, before the commit
        may_read.set()
        assert checked.wait(60)
        return real_confirm(dst, name)

    monkeypatch.setattr(transfer, "confirm", confirm)
    report = src.push("origin")
    t.join(60)
    assert not errors, errors
    assert report.snapshots_sent == [snap.ref]
    gc_a.close()
    gc_b.close()
    monkeypatch.setattr(ObjectStore, "blob_bytes", real_bytes)
    monkeypatch.setattr(Maintenance, "index_manifest_ids", real_ids)
    with ckstore.open(tmp_path / "remote") as again:
        assert [s.id for s in again.log()] == [snap.id]
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 1)
    src.close()


def test_a_push_whose_put_back_keeps_failing_deletes_the_snapshot_there_and_the_next_sends_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote's gc prunes and deletes the manifest between the push's put (found in place)
    and its commit, and the push's put-back after the commit keeps failing (the storage does
    not answer). Before, the push raised with the snapshot committed there, unreadable, and
    every later push found it there and sent nothing. Now the push tries again, then deletes
    the snapshot there and raises; the next push sends it again."""
    from ckstore.objects.store import ObjectStore

    src, remote = pushed_yesterday(tmp_path, [1, 2, 3])
    snap = src.get("r@2")
    remote.delete(snap.id)

    real = transfer.confirm
    ran: list[object] = []

    def confirm(dst, name):
        if not ran:
            ran.append(remote.gc())
        return real(dst, name)

    real_back = ObjectStore.put_blob_back
    failed: list[bool] = []

    def put_blob_back(self, kind, data):  # the storage does not answer for a while
        if len(failed) < 10:
            failed.append(True)
            raise StorageError("store: no answer within 30 s")
        return real_back(self, kind, data)

    monkeypatch.setattr(transfer, "confirm", confirm)
    monkeypatch.setattr(ObjectStore, "put_blob_back", put_blob_back)
    with pytest.raises(StorageError, match="deleted there again: transfer it again"):
        src.push("origin")
    assert len(failed) == transfer.PUT_BACK_TRIES  # tried again, then gave the snapshot up
    with ckstore.open(tmp_path / "remote") as there:
        assert snap.id not in {s.id for s in there.log()}  # not left there unreadable
    monkeypatch.setattr(transfer, "confirm", real)
    monkeypatch.setattr(ObjectStore, "put_blob_back", real_back)
    src.push("origin")  # the retry: the storage answers again
    remote.close()
    with ckstore.open(tmp_path / "remote") as again:
        assert snap.id in {s.id for s in again.log()}
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 2)
    src.close()
