"""What a two-tier store says when its remote lacks what it evicted there, and what ``du`` says
of the bytes only the remote holds (issue 35, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckstore
from ckstore import cli, objects
from tests.support.remotes import KNOBS, fill, restores


def test_a_missing_remote_pack_names_the_remote_its_place_and_the_snapshots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote_dir = tmp_path / "remote"
    store = ckstore.open(
        tmp_path / "local",
        create=True,
        push_to=str(remote_dir),
        local_budget=5 * KNOBS["pack_bytes"],
        auto_compact=False,
        **KNOBS,
    )
    try:
        fill(store, "r", range(1, 9))
        assert store.wait_pushed(timeout=60)
    finally:
        store.close()
    # du: what lives at the remote only (evicted from this disk)
    assert cli.main(["--store", str(tmp_path / "local"), "du"]) == 0
    assert "at a remote only:" in capsys.readouterr().out
    with ckstore.open(tmp_path / "local") as plain:
        usage = plain.du()[-1]
        assert 0 < usage.remote_bytes <= usage.stored_bytes
        remote_packs = plain.repository.index.remote_pack_ids()
        first = plain.repository.index.snapshot_chunk_ids(plain.get("r@1").id)
        victim = next(
            c
            for c in plain.repository.index.all_chunks()
            if c.pack_id in remote_packs and c.chunk_id in first
        )
    (remote_dir / objects.pack_name(victim.pack_id)).unlink()  # the remote lost it
    with ckstore.open(tmp_path / "local") as plain:
        with pytest.raises(ckstore.CkstoreError) as exc:
            restores(plain, "r@1", 1)
    message = str(exc.value)
    assert "remote 'tier'" in message and str(remote_dir) in message
    assert "r@1" in message and "cannot be read until it is back" in message, message
    assert "found moved there" not in message  # the jargon it replaced
