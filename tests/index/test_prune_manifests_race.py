"""PostgreSQL: gc's ``prune_manifests`` beside a commit that names one of its manifests again
(a pull re-sending a snapshot deleted here: ``_commit.add_manifest`` finds the row and adds no
entries). The prune holds the GC barrier, so the commit runs wholly before or after it. Before,
the prune deleted the manifest's entries, the commit landed in between, and the row stayed
without them: the committed snapshot listed no keys (``entries()``, ``show``, ``diff``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ckstore.index import Index, maintenance
from tests.index.helpers import ENTRIES, add_chunks, snapshot
from tests.support.pgserver import PgServer

pytestmark = pytest.mark.postgres


def _commit_again(ix: Index, record: Any, labels: list[str]) -> None:
    session = ix.begin_session("pull", 30)
    ids = add_chunks(ix, session.id, f"pack-{time.time_ns()}", labels)
    ix.commit_snapshot(session.id, record, ENTRIES, ids, 321, tags=())


def test_a_manifest_named_again_during_its_prune_keeps_its_entries(
    pg: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = pg.new_database()
    gc_side = Index.open(url)
    puller = Index.open(url)  # another process's index handle
    try:
        record = snapshot("r", 1, manifest="m-shared")
        _commit_again(puller, record, ["a", "b"])
        gc_side.delete_snapshot(record.id)  # deleted here, the manifest row now unused

        real = maintenance.batches
        fired: list[bool] = []

        pull = threading.Thread(target=_commit_again, args=(puller, record, ["a", "b"]))

        def batches(items: Any, *args: Any, **kwargs: Any) -> Any:
            if not fired:  # prune_manifests listed its ids; the pull commits right now
                fired.append(True)
                pull.start()
                pull.join(timeout=3.0)  # it finishes, unless it waits for the prune
            return real(items, *args, **kwargs)

        monkeypatch.setattr(maintenance, "batches", batches)
        gc_side.prune_manifests(time.time() + 60)
        monkeypatch.undo()
        assert fired
        pull.join(timeout=60)
        assert not pull.is_alive()

        assert puller.get_snapshot(record.id).manifest_id == "m-shared"  # committed, visible
        got = [e.key for e in puller.entries("m-shared")]
        assert got == [e.key for e in ENTRIES], f"the committed snapshot's entries: {got}"
    finally:
        puller.close()
        gc_side.close()
