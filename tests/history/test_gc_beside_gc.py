"""Two gcs beside each other, one orphan pack: the one that finds it gone goes on. Before, it
read the size of each orphan it had listed without a guard, so when the other gc had deleted
it meanwhile it raised ObjectNotFoundError and skipped its manifest sweep and log shrink."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore import objects
from ckstore.index.maintenance import Maintenance
from tests.conftest import TINY


def test_a_gc_beside_another_survives_an_orphan_the_other_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    one = ckstore.open(path, create=True, **TINY)
    two = ckstore.open(path, **TINY)  # another process's handle
    try:
        payload = b"orphaned by a take killed before add_pack" * 4
        writer = one.repository.objects.new_pack_writer(8192)
        writer.add(objects.chunk_id(payload), "none", payload, len(payload))
        orphan = writer.finish()
        assert orphan is not None and orphan[0] in one.repository.objects.list_packs()

        real = Maintenance.index_pack_ids  # _delete_orphans asks after it listed the packs
        done: list[Any] = []

        def index_pack_ids(self: Maintenance) -> set[str]:
            if not done:
                done.append(None)
                done[0] = two.gc(grace_seconds=0)  # the other gc sweeps the orphan first
            return real(self)

        monkeypatch.setattr(Maintenance, "index_pack_ids", index_pack_ids)
        one.gc(grace_seconds=0)
        assert done and done[0].orphans_removed == 1
    finally:
        two.close()
        one.close()
