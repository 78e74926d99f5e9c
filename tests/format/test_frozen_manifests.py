"""A distributed take's manifest stored whole (format version 1), frozen as the last release
before manifests in parts wrote it (``fixture_manifests``), still reads, restores bit for bit
(one process, and two ranks into other placements), checks, diffs and reindexes; the same
state taken again is stored in parts and holds the same thing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from ckstore.format.manifest import PerRankEntry, entry_digest
from ckstore.index.schema import upgrade
from tests.distributed import scenarios as sc
from tests.support.ranks import run_ranks, values

from .fixture_manifests import DATA, RUN, sha

pytestmark = pytest.mark.timeout(300)
EXPECTED = json.loads((DATA / "expected.json").read_text())


@pytest.fixture
def frozen(tmp_path: Path) -> Path:
    """A private copy of the frozen store, its index migrated as a user upgrading does (the
    frozen index revisions themselves are tests/index's; the manifests are what this file holds)."""
    path = tmp_path / "store"
    shutil.copytree(DATA / "store", path)
    upgrade(f"sqlite:///{path / 'index.sqlite'}")
    return path


def test_the_frozen_store_was_written_whole_by_its_release() -> None:
    assert EXPECTED["manifest_version"] == 1 and len(EXPECTED["local"]) == 2
    raw = json.loads((DATA / "store/manifests" / EXPECTED["id"][:2] / EXPECTED["id"]).read_text())
    assert raw["version"] == 1 and raw["snapshot"]["world_size"] == 2


def test_reads_restores_and_checks_in_one_process(frozen: Path) -> None:
    with ckstore.open(frozen) as store:
        snap = store.get(f"{RUN}@1")
        assert snap.id == EXPECTED["id"] and snap.record.world_size == 2
        assert not snap.manifest.parts and not snap.manifest.parted
        assert isinstance(snap.manifest.entries["local/mine"], PerRankEntry)
        for key, digest in EXPECTED["global"].items():
            assert sha(snap.read_object(f"g/{key}")) == digest, key
        for key in ("mine", "small", "same_t"):
            got = snap.read_object(f"local/{key}")
            ranks = got if isinstance(got, list) else [got, got]  # equal everywhere: stored once
            assert [sha(t) for t in ranks] == [r[key] for r in EXPECTED["local"]], key
        report = store.check(read_data=True)
        assert report.ok, report.problems


def test_two_ranks_restore_it_into_other_placements(frozen: Path, tmp_path: Path) -> None:
    values(run_ranks(sc.restore_dtensors, 2, tmp_path, str(frozen), {RUN: 2}))


def _take_again(rank: int, world: int, path: str) -> dict[str, Any]:
    with ckstore.open(path) as store:
        app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "local": sc.local_app(rank)}
        snap = store.take(app, run="again", step=1)
        return {"id": snap.id, "stats": snap.stats}


def test_the_same_state_taken_again_is_stored_in_parts_and_the_same(
    frozen: Path, tmp_path: Path
) -> None:
    (again, _) = values(run_ranks(_take_again, 2, tmp_path, str(frozen)))
    with ckstore.open(frozen) as store:
        old, new = store.get(f"{RUN}@1"), store.get("again@1")
        assert len(new.manifest.parts) == 2 and new.manifest.parted  # version 2
        assert again["stats"]["new_chunks"] == 0  # every piece dedups against the old take
        # the same, assembled (the new one also records its chunks' checks; the digest leaves
        # them out)
        digests = {k: entry_digest(e) for k, e in new.manifest.entries.items()}
        assert digests == {k: entry_digest(e) for k, e in old.manifest.entries.items()}
        assert new.manifest.entries.keys() == old.manifest.entries.keys()
        d = store.diff(old.id, new.id)
        assert {k.status for k in d.keys} == {"unchanged"}, [
            k for k in d.keys if k.status != "unchanged"
        ]
        assert store.check(read_data=True).ok
        entries = {e.key: e for e in new.entries()}
    index = f"sqlite:///{tmp_path / 'rebuilt.sqlite'}"
    with ckstore.open(frozen, index=index, create=True) as rebuilt:
        report = rebuilt.reindex()
        assert report.snapshots == 2 and not report.skipped, report
        snap = rebuilt.get("again@1")
        assert snap.record.world_size == 2 and snap.record.logical_bytes == new.record.logical_bytes
        assert {e.key: e for e in snap.entries()} == entries  # digests of entries in parts too
        assert rebuilt.check(read_data=True).ok
