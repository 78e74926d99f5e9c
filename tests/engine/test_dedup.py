"""Incremental takes store only what changed; shared content is stored once."""

from __future__ import annotations

import torch

import ckstore
from ckstore import objects


def _pack_bytes(store) -> int:
    return sum(store.repository.objects.pack_size(p) for p in store.repository.objects.list_packs())


def test_second_take_of_unchanged_state_writes_no_chunk_bytes(store):
    state = ckstore.StateDict({f"w{i}": torch.randn(64, 64) for i in range(4)})
    first = store.take({"s": state}, run="r", step=1)
    assert first.stats["new_chunks"] > 4
    before = _pack_bytes(store)
    second = store.take({"s": state}, run="r", step=2)
    assert second.stats["new_bytes"] == 0 and second.stats["new_chunks"] == 0
    assert second.stats["reused_chunks"] == first.stats["new_chunks"]
    assert _pack_bytes(store) == before
    assert second.parent_id == first.id


def test_changing_one_of_ten_tensors_writes_only_that_tensor(store):
    state = ckstore.StateDict({f"w{i}": torch.randn(32, 32) for i in range(10)})
    store.take({"s": state}, run="r", step=1)
    state["w3"][5:9] += 1.0  # touch a few rows of one tensor
    snap = store.take({"s": state}, run="r", step=2)
    tensor_bytes = state["w3"].numel() * 4
    # at most that tensor plus one chunk (here: only the chunks holding the changed rows)
    assert 0 < snap.stats["new_chunks"] <= tensor_bytes // store.config.chunk_bytes + 1
    assert snap.stats["new_bytes"] <= tensor_bytes + store.config.chunk_bytes


def test_two_models_sharing_a_backbone_share_its_chunks(store):
    torch.manual_seed(0)
    backbone = torch.nn.Linear(64, 64)
    head_a, head_b = torch.nn.Linear(64, 4), torch.nn.Linear(64, 4)
    a = store.take({"backbone": backbone, "head": head_a}, run="a")
    b = store.take({"backbone": backbone, "head": head_b}, run="b")
    backbone_chunks = {
        c.id
        for k, e in a.manifest.entries.items()
        if k.startswith("backbone/") and e.kind == "tensor"
        for c in e.chunks
    }
    assert backbone_chunks and backbone_chunks <= b.manifest.chunk_ids()
    assert b.stats["reused_chunks"] >= len(backbone_chunks)
    assert b.stats["new_bytes"] < a.stats["new_bytes"] / 4


def test_identical_chunks_inside_one_take_are_written_once(store):
    state = ckstore.StateDict({"a": torch.zeros(64, 64), "b": torch.zeros(64, 64)})
    snap = store.take({"s": state}, run="r")
    assert snap.stats["new_chunks"] == 1  # every 1 KiB block of zeros is the same chunk


def test_sibling_stores_do_not_share_but_a_store_dedups_across_runs(tmp_path):
    s = ckstore.open(tmp_path / "one", chunk_bytes=1024, create=True)
    state = ckstore.StateDict({"w": torch.randn(100, 100)})
    s.take({"s": state}, run="a")
    assert s.take({"s": state}, run="b").stats["new_chunks"] == 0


def test_read_object_reads_only_that_tensors_chunks(store_path):
    setup = ckstore.open(
        store_path, chunk_bytes=4096, pack_bytes=1 << 20, inline_bytes=64, create=True
    )
    state = ckstore.StateDict({f"w{i}": torch.randn(128, 64) for i in range(6)})
    setup.take({"s": state}, run="r")
    setup.close()

    store = ckstore.open(store_path, create=True)
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    snap = store.get("r")
    _ = snap.manifest  # the manifest read is not tensor data
    counting.reset()
    t = snap.read_object("s/w2")
    assert torch.equal(t, state["w2"])
    tensor_bytes = state["w2"].numel() * 4
    pack_reads = [g for g in counting.gets if g.name.startswith("packs/")]
    assert sum(g.nbytes for g in pack_reads) <= tensor_bytes + 4096
    assert len(pack_reads) == tensor_bytes // 4096  # one ranged read per chunk
