"""A snapshot sent again (push or pull) while a gc at the destination deletes its manifest.

A manifest is named by its bytes: sent again, it is found in place (nothing written) while the
gc prunes its unused row and deletes the object, or sweeps it as an orphan; the commit then
made a snapshot whose manifest was gone (unreadable, and lost for good once the other copy
went). The writer now puts it back after its commit if it is gone, and the gc puts back what a
row names once it deleted it (``ObjectStore.store_blob``); each test failed before.
"""

from __future__ import annotations

import importlib
import sqlite3

import pytest

import ckstore
from tests.support.manifest_races import killed_push, pushed_yesterday
from tests.support.remotes import KNOBS, fill, restores

transfer = importlib.import_module("ckstore.remote.transfer")


def test_a_snapshot_pushed_again_while_the_remotes_gc_prunes_its_old_manifest(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, remote = pushed_yesterday(tmp_path, [1, 2, 3])
    snap = src.get("r@2")
    remote.delete(snap.id)  # the remote's retention dropped it (or someone deleted it there)

    real = transfer.confirm
    ran: list[object] = []

    def confirm(dst, name):  # between the manifest put and the commit
        if not ran:
            ran.append(remote.gc())  # the default grace period (6 h)
        return real(dst, name)

    monkeypatch.setattr(transfer, "confirm", confirm)
    report = src.push("origin")  # every run: r@2 is not there any more, so it goes again
    assert ran, "the remote's gc did not run during the push"
    assert report.snapshots_sent == [snap.ref]
    assert src.push_status()[snap.id].state == "pushed"

    with ckstore.open(tmp_path / "remote") as again:
        assert snap.id in {s.id for s in again.log()}  # visible there, recorded as pushed here
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 2)
    remote.close()
    src.close()


def test_a_push_retried_while_the_remotes_orphan_sweep_runs(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push killed between its manifest put and its commit leaves the manifest object an
    orphan. The retried push finds it there (nothing written) while a gc of the remote, which
    checked that no session was alive before the retry began, deletes it: the commit then makes
    a snapshot whose manifest is gone."""
    from ckstore.index.maintenance import Maintenance

    src = ckstore.open(tmp_path / "src", create=True, **KNOBS)
    fill(src, "r", [1])
    src.add_remote("origin", tmp_path / "remote")
    snap = src.get("r@1")

    killed_push(src, monkeypatch)

    remote = ckstore.open(tmp_path / "remote")
    assert remote.log() == []
    real_ids = Maintenance.index_manifest_ids
    pushed: list[object] = []

    def ids(self, among=None):
        known = real_ids(self, among)  # the sweep's view of the index, before the retry...
        if among is None and not pushed:
            pushed.append(src.push("origin"))  # ...which runs now, whole
        return known

    monkeypatch.setattr(Maintenance, "index_manifest_ids", ids)
    remote.gc(grace_seconds=0)
    monkeypatch.setattr(Maintenance, "index_manifest_ids", real_ids)
    assert pushed and pushed[0].snapshots_sent == [snap.ref]
    assert src.push_status()[snap.id].state == "pushed"
    remote.close()

    with ckstore.open(tmp_path / "remote") as again:
        assert [s.id for s in again.log()] == [snap.id]
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 1)
    src.close()


def test_a_snapshot_pulled_back_while_this_stores_own_gc_prunes_its_old_manifest(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through a pull: a snapshot deleted here is pulled back from the remote while
    this store's own gc (another process, default grace period) prunes its manifest."""
    local = ckstore.open(tmp_path / "local", create=True, **KNOBS)
    fill(local, "r", [1, 2, 3])
    local.add_remote("origin", tmp_path / "remote")
    local.push("origin")
    snap = local.get("r@2")
    local.delete(snap.id)  # deleted here by mistake; the remote still holds it
    local.close()
    with sqlite3.connect(tmp_path / "local" / "index.sqlite") as db:  # taken yesterday
        db.execute("UPDATE manifests SET created_at = created_at - 86400")
    local = ckstore.open(tmp_path / "local")
    other = ckstore.open(tmp_path / "local")  # this store's gc, as another process runs it

    real = transfer.commit_manifest
    ran: list[object] = []

    def commit_manifest(*a, **k):  # between the manifest put and the commit
        if not ran:
            ran.append(other.gc())
        return real(*a, **k)

    monkeypatch.setattr(transfer, "commit_manifest", commit_manifest)
    report = local.pull("origin", [snap.id])
    assert ran and report.snapshots_sent == [snap.ref]
    other.close()
    local.close()
    with ckstore.open(tmp_path / "local") as again:
        assert snap.id in {s.id for s in again.log()}
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 2)


def test_a_snapshot_pushed_again_between_the_gcs_read_and_delete_of_its_manifest(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the push finds the manifest in place, commits and checks it is still
    there, all before the gc (which pruned its row) deletes it. The gc, checking the index
    after its delete, sees the row the push recorded and puts the manifest back."""
    from ckstore.objects.store import ObjectStore

    src, remote = pushed_yesterday(tmp_path, [1, 2, 3])
    snap = src.get("r@2")
    remote.delete(snap.id)

    real = ObjectStore.blob_bytes
    pushed: list[object] = []

    def blob_bytes(self, kind, blob_id):  # the gc reads what it is about to delete...
        if not pushed:
            pushed.append(src.push("origin"))  # ...while the push runs through, whole
        return real(self, kind, blob_id)

    monkeypatch.setattr(ObjectStore, "blob_bytes", blob_bytes)
    report = remote.gc()
    monkeypatch.setattr(ObjectStore, "blob_bytes", real)
    assert pushed and pushed[0].snapshots_sent == [snap.ref]
    assert report.manifests_removed == 0  # the one it pruned came back
    remote.close()
    with ckstore.open(tmp_path / "remote") as again:
        assert again.check().ok, again.check().problems
        assert restores(again, snap.id, 2)
    src.close()
