"""``forget_removed`` (``ckstore sync-folder``) on a store opened read-only (a read-only mount
opens so by itself) where no step folder was removed: nothing to delete, so nothing is
written and the report says so, as before retention expired sessions in the index first."""

from __future__ import annotations

from pathlib import Path

import ckstore
from ckstore.dcp import forget_removed
from tests.dcp import folder_scenarios as fs


def test_a_read_only_store_with_nothing_removed_reports_nothing_deleted(tmp_path: Path) -> None:
    url, folder = fs.marked_titan(tmp_path)
    with ckstore.open(url, read_only=True) as store:
        report = forget_removed(folder, store)
    assert report.deleted == () and report.paused is None
