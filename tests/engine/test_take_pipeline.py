"""The take pipeline: concurrent pack writes, recycled encode buffers, batched hashing.

Speed is measured in bench/, not here; these tests pin down what the pipeline must never get
wrong while it overlaps work: every chunk lands exactly once and reads back bit-exact, memory
stays bounded, and a failing pack write fails the whole take with nothing visible and no
writer thread left running.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.take import local as local_take
from ckstore.engine.take import packing
from ckstore.errors import StorageError


def _state(n: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # float tensors (byte-grouped, so encoded into recycled buffers), ints (plain zstd) and
    # random bytes (left raw): every codec path of the pipeline
    out = {f"w{i}": torch.empty(37, 29).normal_(0, 0.02, generator=g) for i in range(n)}
    out["ints"] = torch.arange(5000, dtype=torch.int64) % 7
    out["noise"] = torch.randint(0, 256, (9000,), dtype=torch.uint8, generator=g)
    out["dup_a"] = torch.ones(3000)
    out["dup_b"] = torch.ones(3000)  # same chunks as dup_a: stored once
    return out


def test_many_packs_written_concurrently_read_back_exactly(store: ckstore.Store) -> None:
    state = _state()
    snap = store.take({"s": ckstore.StateDict(state)}, run="r", step=0)
    packs = store.repository.objects.list_packs()
    assert len(packs) > 2 * packing.TakeOptions.io_threads  # several waves of concurrent flushes
    assert snap.stats["new_chunks"] == len(snap.manifest.chunk_ids())  # each chunk written once
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    store.get("r").restore({"s": ckstore.StateDict(dest)})
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    report = store.check(read_data=True)
    assert report.ok, report.problems


def test_batches_cut_by_bytes_and_by_count() -> None:
    chunks = [packing.Chunk("k", memoryview(bytes(n)), 1, False) for n in (5, 5, 5, 20, 1, 1, 1)]
    sizes = [[len(c.view) for c in b] for b in packing.batches(chunks, max_bytes=10, max_count=2)]
    assert sizes == [[5, 5], [5], [20], [1, 1], [1]]
    assert [c for b in packing.batches(chunks, 10, 2) for c in b] == chunks  # order kept


def test_batches_start_small_and_double() -> None:
    chunks = [packing.Chunk("k", memoryview(bytes(4)), 1, False) for _ in range(16)]
    sizes = [sum(len(c.view) for c in b) for b in packing.batches(chunks, 24, 100, first_bytes=4)]
    assert sizes == [4, 8, 16, 24, 12]


def test_hashing_in_batches_finds_duplicates_across_batches(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_take, "HASH_BATCH_CHUNKS", 3)
    state = _state(4)
    snap = store.take({"s": ckstore.StateDict(state)}, run="r", step=0)
    assert snap.stats["new_chunks"] == len(snap.manifest.chunk_ids())
    again = store.take({"s": ckstore.StateDict(state)}, run="r", step=1)
    assert again.stats["new_chunks"] == 0 and again.stats["new_bytes"] == 0


@pytest.mark.parametrize("fail_at", [2, 7])
def test_a_failing_pack_write_fails_the_take_with_nothing_visible(
    store: ckstore.Store, fail_at: int
) -> None:
    faulty = objects.FaultyBackend(store.repository.objects.backend, fail_put_at=fail_at)
    store.repository.objects = objects.ObjectStore(faulty)
    with pytest.raises(StorageError):
        store.take({"s": ckstore.StateDict(_state())}, run="r", step=0)
    assert store.log() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("ckstore-pack")]
    # the store still works: the next take succeeds and reads back
    store.repository.objects = objects.ObjectStore(faulty.inner)
    state = _state()
    store.take({"s": ckstore.StateDict(state)}, run="r", step=1)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    store.get("r").restore({"s": ckstore.StateDict(dest)})
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_encode_into_a_recycled_buffer_matches_a_fresh_one() -> None:
    raw = torch.empty(4096).normal_(0, 0.02).numpy().tobytes()
    fresh = objects.encode(raw, 4, True)
    buf = bytearray(b"\xff" * (objects.grouped_size(len(raw), 4) + 100))  # dirty and too big
    reused = objects.encode(raw, 4, True, 1, buf)
    assert reused[0] == fresh[0] == objects.BYTEGROUP_ZSTD
    assert bytes(reused[1]) == bytes(fresh[1])
    assert bytes(objects.decode(reused[0], reused[1], len(raw))) == raw
    small = bytearray(10)  # too small: ignored, never written past its end
    assert bytes(objects.encode(raw, 4, True, 1, small)[1]) == bytes(
        fresh[1]
    ) and small == bytearray(10)


def test_io_threads_from_the_environment(store_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKSTORE_IO_THREADS", "1")
    with ckstore.open(
        store_path, chunk_bytes=1024, pack_bytes=8192, inline_bytes=64, create=True
    ) as s:
        assert s.io_threads == 1
        state = _state(6)
        s.take({"s": ckstore.StateDict(state)}, run="r")  # one pack written at a time
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        s.get("r").restore({"s": ckstore.StateDict(dest)})
        assert all(torch.equal(dest[k], v) for k, v in state.items())
