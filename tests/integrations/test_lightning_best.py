"""Review: a tag of yours named exactly ``<run>/best`` is still taken for the plugin's own."""

from __future__ import annotations

from pathlib import Path

import torch

import ckstore
from ckstore.integrations.lightning import CkstoreCheckpointIO


def test_a_tag_of_yours_named_run_best_keeps_its_snapshot_when_the_plugin_never_tagged_best(
    tmp_path: Path,
) -> None:
    """No monitored ModelCheckpoint (the plugin records ``best_tags: []`` and never tags a
    best): you tag a checkpoint ``lit/best`` yourself; the file's removal (top-k of the newest)
    untags yours and deletes the snapshot."""
    store = ckstore.open(tmp_path / "store", create=True, chunk_bytes=1024, pack_bytes=8192)
    io = CkstoreCheckpointIO(store, run="lit")
    path = tmp_path / "ck" / "epoch=1.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(300)}}, path)
    sid = store.get(io.ref(path)).id
    assert store.get(sid).metadata["lightning"]["best_tags"] == []
    store.tag(sid, "lit/best")  # yours: "the best of this run", by your own judgement
    io.remove_checkpoint(path)
    try:
        assert not path.exists()
        assert store.tags().get("lit/best") == sid, store.tags()
        assert store.get("lit/best").step == 1
    finally:
        store.close()
