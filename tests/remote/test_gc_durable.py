"""gc never deletes the only durable copy of a snapshot (issue 34, item 6; RELIABILITY I7).

On a two-tier store the tier remote's copy is the durable one once it holds a snapshot; the
local record of that (``mark_pushed``) is this store's word. So gc asks the remote first: a
snapshot its index lost is kept here and pushed again, and while the remote cannot be opened
every snapshot recorded as held there is kept. A dry run predicts the same and changes nothing.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

import ckstore
from tests.support.remotes import KNOBS, fill, restores, tiered


def test_a_snapshot_the_remote_lost_is_kept_and_pushed_again(tmp_path: Path, caplog) -> None:
    with tiered(tmp_path) as store:
        with ckstore.open(tmp_path / "remote") as remote:
            remote.delete("r@1", force=True)  # its index restored from an older backup
        r1 = store.get("r@1").id
        caplog.set_level(logging.WARNING, "ckstore")
        dry = store.gc(keep_last=1, grace_seconds=0, dry_run=True)
        assert dry.snapshots_dropped == ["r@2"] and dry.snapshots_kept_unpushed == 1
        assert store.push_status()[r1].state == "pushed"  # a dry run changes nothing
        report = store.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == ["r@2"] and report.snapshots_kept_unpushed == 1
        assert "lacks 1 snapshot" in caplog.text
        assert store.push_status()[r1].state == "pushing"
        assert restores(store, "r@1", 1) and store.check(read_data=True).ok
        store.push("tier")  # it goes again
    with ckstore.open(tmp_path / "remote") as remote:
        assert restores(remote, "r@1", 1)


def test_while_the_remote_cannot_be_opened_nothing_pushed_there_is_dropped(
    tmp_path: Path, caplog
) -> None:
    with tiered(tmp_path) as store:
        shutil.move(tmp_path / "remote", tmp_path / "away")  # an unmounted share
        caplog.set_level(logging.WARNING, "ckstore")
        report = store.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == [] and report.snapshots_kept_unpushed == 2
        assert "cannot show it holds them" in caplog.text
        assert {s.state for s in store.push_status().values()} == {"pushed"}  # not forgotten
        shutil.move(tmp_path / "away", tmp_path / "remote")
        assert sorted(store.gc(keep_last=1, grace_seconds=0).snapshots_dropped) == ["r@1", "r@2"]
        assert restores(store, "r@3", 3)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_store_without_a_tier_asks_no_remote(tmp_path: Path, dry_run: bool) -> None:
    with ckstore.open(tmp_path / "s", create=True, **KNOBS) as store:
        fill(store, "r", [1, 2])
        store.add_remote("origin", tmp_path / "nowhere")  # not a tier: never opened by gc
        report = store.gc(keep_last=1, grace_seconds=0, dry_run=dry_run)
        assert report.snapshots_dropped == ["r@1"] and report.snapshots_kept_unpushed == 0
