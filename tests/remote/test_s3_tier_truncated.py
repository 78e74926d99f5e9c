"""An S3 tier remote that acknowledges pack puts but stores fewer bytes (RELIABILITY I7).

The server answers 200 to every ``PutObject`` of a pack and keeps the first half of its body
(simulated below the S3 backend: the body cut, its CRC32 recomputed, so the server stores and
acknowledges it). Eviction never trusted it (each remote pack's size is checked); retention
did: the push recorded every snapshot as pushed, and ``gc`` dropped snapshots of the two-tier
store on the remote index's word, deleting the local packs, so they were lost in both tiers.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

import ckstore
from ckstore.objects import s3 as s3_mod
from ckstore.remote import uploader as uploader_mod
from tests.support.remotes import KNOBS, fill, restores, tiered

pytestmark = pytest.mark.s3


@pytest.fixture
def truncating_packs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every pack ``PutObject`` into a bucket named ``ck-trunc-*`` stores half its body."""
    cut = {"packs": 0}
    real = s3_mod.S3Backend._s3

    def _s3(self: Any, method: str, nbytes: int = 0, **kw: Any) -> Any:
        if (
            method == "put_object"
            and str(kw.get("Bucket", "")).startswith("ck-trunc-")
            and "/packs/" in str(kw.get("Key", ""))
        ):
            body = kw["Body"][: len(kw["Body"]) // 2]
            kw = {**kw, "Body": body, "ChecksumCRC32": s3_mod.crc32(body)}
            cut["packs"] += 1
        return real(self, method, len(kw.get("Body", b"")) or nbytes, **kw)

    monkeypatch.setattr(s3_mod.S3Backend, "_s3", _s3)
    monkeypatch.setattr(uploader_mod, "RETRY_SECONDS", (0.05, 0.2))
    monkeypatch.setattr(uploader_mod, "CLOSE_ATTEMPTS", 1)
    return cut


def test_gc_keeps_what_a_tier_remote_is_recorded_to_hold_but_holds_cut_short(
    tmp_path: Path, s3_server: Any, truncating_packs: dict[str, int]
) -> None:
    bucket = f"ck-trunc-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    remote = {
        "push_to": f"s3://{bucket}/tier",
        "remote_index": f"sqlite:///{tmp_path / 'remote.sqlite'}",
        "remote_options": s3_server.storage_options(),
    }
    with ckstore.open(
        tmp_path / "local", create=True, auto_compact=False, **remote, **KNOBS
    ) as store:
        fill(store, "r", [1, 2, 3])
        assert store.wait_pushed(timeout=120)
        assert truncating_packs["packs"] > 0
        assert {s.state for s in store.push_status().values()} == {"pushed"}
        report = store.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == [] and report.snapshots_kept_unpushed == 2
        assert all(restores(store, f"r@{step}", step) for step in (1, 2, 3))
        assert store.check(read_data=True).ok


@pytest.mark.parametrize("damage", ["missing", "cut_short"])
def test_gc_keeps_what_a_tier_remote_holds_without_its_manifest(
    tmp_path: Path, damage: str
) -> None:
    """The remote's packs whole, its manifest of r@1 lost or cut short: before, the proof
    checked only the packs, and gc dropped r@1 here, the last copy of its manifest."""
    with tiered(tmp_path) as store:
        r1 = store.get("r@1").id
        manifest = tmp_path / "remote" / "manifests" / r1[:2] / r1
        if damage == "missing":
            manifest.unlink()
        else:
            manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
        report = store.gc(keep_last=1, grace_seconds=0)
        assert report.snapshots_dropped == ["r@2"] and report.snapshots_kept_unpushed == 1
        assert restores(store, "r@1", 1) and store.check(read_data=True).ok
