"""Deltas beside maintenance: gc, check and reindex never break a chain or report garbage as damage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckstore
from ckstore import objects
from tests.support.deltas import KNOBS, App, restores, train


def test_gc_does_not_rewrite_delta_packs_whose_every_chunk_is_live(tmp_path: Path) -> None:
    """A version 2 pack's entries are 96 bytes, not 64: its payload must not be overestimated
    so that a pack with nothing dead looks sparse and is rewritten by every gc."""
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        for i, s in enumerate(train(3)):
            store.take({"m": App(dict(s))}, run="r", step=i, delta_base="parent")
        assert any(c.base_id for c in store.repository.index.all_chunks())
        rewritten = [store.gc(grace_seconds=0, repack_below=0.99).packs_rewritten for _ in range(2)]
        assert rewritten == [0, 0]


def test_check_reports_a_delta_against_a_base_of_another_length_and_scans_on(
    tmp_path: Path,
) -> None:
    """A (damaged or crafted) delta whose base has another length is a corrupt chunk: check
    names it and goes on with the rest of its pack, instead of giving up on the pack with an
    internal 'xor of 8 bytes with 16 bytes'."""
    import zstandard

    from ckstore import objects

    with ckstore.open(tmp_path / "s", create=True) as store:
        base = bytes(range(16))
        w = store.repository.objects.new_pack_writer()
        w.add(objects.chunk_id(base), "none", base, len(base))
        w.finish()
        new, bad = bytes(range(8, 16)), b"\x01" * 32
        xor = zstandard.ZstdCompressor(write_content_size=True).compress(
            bytes(a ^ b for a, b in zip(new, base))
        )
        w = store.repository.objects.new_pack_writer()
        w.add(objects.chunk_id(new), objects.XOR_ZSTD, xor, len(new), objects.chunk_id(base))
        w.add(objects.chunk_id(b"\x00" * 32), "none", bad, len(bad))  # a corrupt chunk beside it
        w.finish()
        store.reindex()
        kinds = {(p.kind, p.object) for p in store.check(read_data=True).problems}
        assert ("corrupt-chunk", objects.chunk_id(new)) in kinds
        assert ("corrupt-chunk", objects.chunk_id(b"\x00" * 32)) in kinds
        assert "pack" not in {k for k, _ in kinds}


def test_reindex_leaves_out_chains_longer_than_readers_follow(tmp_path: Path) -> None:
    """Readers refuse a chain over ``MAX_CHAIN`` links: reindex must not index one (it did,
    at any depth, and every read of it then failed saying the index lacked a base)."""
    import os

    import zstandard

    from ckstore import objects
    from ckstore.engine.locations import to_location
    from ckstore.objects.delta import MAX_CHAIN

    z = zstandard.ZstdCompressor(write_content_size=True)
    with ckstore.open(tmp_path / "s", create=True) as store:
        prev = os.urandom(64)
        w = store.repository.objects.new_pack_writer(1 << 30)
        w.add(objects.chunk_id(prev), "none", prev, len(prev))
        ids = [objects.chunk_id(prev)]
        for _ in range(MAX_CHAIN + 3):
            new = os.urandom(64)
            w.add(
                objects.chunk_id(new),
                objects.XOR_ZSTD,
                z.compress(bytes(a ^ b for a, b in zip(new, prev))),
                len(new),
                ids[-1],
            )
            prev = new
            ids.append(objects.chunk_id(new))
        w.finish()
        report = store.reindex()
        assert len(report.skipped) == 3 and all("longer than" in s for s in report.skipped)
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        assert set(rows) == set(ids[: MAX_CHAIN + 1])
        deepest = store.repository.index.chunk_locations([ids[MAX_CHAIN]])
        assert (
            objects.chunk_id(
                store.repository.objects.read_chunk(to_location(deepest[ids[MAX_CHAIN]], deepest))
            )
            == ids[MAX_CHAIN]
        )


def test_check_read_data_is_clean_after_gc_leaves_dead_deltas_in_a_live_pack(
    tmp_path: Path,
) -> None:
    """gc leaves a pack alone while enough of it is live: the deltas in it that nothing needs
    any more stay there, their bases already gone. They are garbage, not damage: check
    --read-data must not report them (it said 'a delta against chunk X, which cannot be read')."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 32, generator=g)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App({"w": w})}, run="r", step=0)
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        kept = torch.randn(16, 16, generator=g)  # new here, unchanged after: its pack stays live
        snap = store.take({"m": App({"w": w, "k": kept})}, run="r", step=1, delta_base="parent")
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        delta_packs = {rows[cid].pack_id for cid in snap.manifest.chunk_ids() if rows[cid].base_id}
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        last = store.take({"m": App({"w": w, "k": kept})}, run="r", step=2, delta_base=None)
        store.gc(keep_last=1, grace_seconds=0, repack_below=0.0)
        assert delta_packs <= set(
            store.repository.objects.list_packs()
        )  # the dead deltas are still stored
        assert not any(c.base_id for c in store.repository.index.all_chunks())
        report = store.check(read_data=True)
        assert report.ok, [p.message for p in report.problems]
        assert restores(store, last.id, {"w": w, "k": kept})


DIGEST_KNOBS: dict[str, Any] = {"chunk_bytes": 4096, "inline_bytes": 64}


def _app(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"m": ckstore.StateDict(dict(state))}


class _FlipOnce(objects.WrappingBackend):
    """Returns one ranged get of ``name`` at ``(offset, length)`` with a byte flipped, once: a
    read that went wrong in transit (the stored object is intact)."""

    def __init__(self, inner: objects.Backend, name: str, offset: int, length: int) -> None:
        super().__init__(inner)
        self.target: tuple[str, int, int | None] | None = (name, offset, length)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.get(name, offset, length)
        if (name, offset, length) == self.target:
            self.target = None
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0x10
            data = bytes(buf)
        return data


def test_gc_never_copies_a_delta_payload_it_did_not_verify(tmp_path: Path) -> None:
    """gc verified a delta by reading it a second time and copied the bytes of its first read,
    recording their digest: one bad read made a damaged payload with a matching digest, which
    an atomic restore only refuses after decoding it into the caller's tensors."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(64, 64, generator=g)
    w1 = w0 + 1e-3 * torch.randn(w0.shape, generator=g)
    with ckstore.open(tmp_path / "s", **DIGEST_KNOBS, create=True) as store:
        store.take(_app({"w": w0}), run="r", step=0)
        store.take(
            _app({"w": w1, "drop": torch.randn(64, 64, generator=g)}),
            run="r",
            step=1,
            delta_base="parent",
        )
        store.take(_app({"w": w1}), run="keep")  # the deltas stay live, "drop" does not
        store.delete("r@1")
        delta = next(c for c in store.repository.index.all_chunks() if c.base_id is not None)
        inner = store.repository.objects.backend
        store.repository.objects = objects.ObjectStore(
            _FlipOnce(inner, objects.pack_name(delta.pack_id), delta.offset, delta.length)
        )
        try:
            store.gc(grace_seconds=0, repack_below=1.0)
        except ckstore.CorruptionError:
            pass  # refusing to copy is right too; copying the bad read is not
        store.repository.objects = objects.ObjectStore(inner)
        dest = {"w": torch.zeros_like(w1)}
        store.get("keep").restore(_app(dest), memory_budget=0)
        assert torch.equal(dest["w"], w1)
        assert store.check(read_data=True).ok
