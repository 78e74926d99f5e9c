"""Deltas, continued: corner cases found in review (each test names what a user would hit)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from _states import forget_payload_digests
from test_deltas import KNOBS, App, _restores, _train

import ckstore


def test_a_trusted_base_whose_pack_is_gone_never_blocks_a_take(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The bases of a training loop's next take are trusted (read or written by this handle):
    a base pack lost meanwhile (a gc beside with no grace, a damaged store) must make the
    take store those chunks whole, as for an untrusted base, not fail it."""
    states = _train(3)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App(dict(states[0]))}, run="r", step=0)
        first_packs = {c.pack_id for c in store.index.all_chunks()}
        store.take({"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent")  # trusts the bases
        for pack_id in first_packs:
            store.objects.delete_pack(pack_id)
        snap = store.take({"m": App(dict(states[2]))}, run="r", step=2, delta_base="parent")
        assert "storing the chunk whole" in caplog.text
        assert _restores(store, snap.id, states[2])


def test_gc_does_not_rewrite_delta_packs_whose_every_chunk_is_live(tmp_path: Path) -> None:
    """A version 2 pack's entries are 96 bytes, not 64: its payload must not be overestimated
    so that a pack with nothing dead looks sparse and is rewritten by every gc."""
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        for i, s in enumerate(_train(3)):
            store.take({"m": App(dict(s))}, run="r", step=i, delta_base="parent")
        assert any(c.base_id for c in store.index.all_chunks())
        rewritten = [store.gc(grace_seconds=0, repack_below=0.99).packs_rewritten for _ in range(2)]
        assert rewritten == [0, 0]


def test_check_reports_a_delta_against_a_base_of_another_length_and_scans_on(tmp_path: Path) -> None:
    """A (damaged or crafted) delta whose base has another length is a corrupt chunk: check
    names it and goes on with the rest of its pack, instead of giving up on the pack with an
    internal 'xor of 8 bytes with 16 bytes'."""
    import zstandard

    from ckstore import objects

    with ckstore.open(tmp_path / "s", create=True) as store:
        base = bytes(range(16))
        w = store.objects.new_pack_writer()
        w.add(objects.chunk_id(base), "none", base, len(base))
        w.finish()
        new, bad = bytes(range(8, 16)), b"\x01" * 32
        xor = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(a ^ b for a, b in zip(new, base)))
        w = store.objects.new_pack_writer()
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
        w = store.objects.new_pack_writer(1 << 30)
        w.add(objects.chunk_id(prev), "none", prev, len(prev))
        ids = [objects.chunk_id(prev)]
        for _ in range(MAX_CHAIN + 3):
            new = os.urandom(64)
            w.add(objects.chunk_id(new), objects.XOR_ZSTD, z.compress(bytes(a ^ b for a, b in zip(new, prev))),
                  len(new), ids[-1])
            prev = new
            ids.append(objects.chunk_id(new))
        w.finish()
        report = store.reindex()
        assert len(report.skipped) == 3 and all("longer than" in s for s in report.skipped)
        rows = {c.chunk_id: c for c in store.index.all_chunks()}
        assert set(rows) == set(ids[: MAX_CHAIN + 1])
        deepest = store.index.chunk_locations([ids[MAX_CHAIN]])
        assert objects.chunk_id(store.objects.read_chunk(to_location(deepest[ids[MAX_CHAIN]], deepest))) == ids[MAX_CHAIN]


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "no-digests"])
def test_a_delta_payload_that_changes_between_the_restore_passes_is_never_decoded_into_place(
    tmp_path: Path, digests: bool
) -> None:
    """The second pass of a restore checks a chunk's payloads (against their recorded digests,
    or without them against fingerprints taken in the first pass) *before* decoding into the
    caller's tensor (docs/RELIABILITY.md, I3): a delta's chain too, so a payload changed
    between the passes leaves that chunk's elements untouched, never wrong."""
    from ckstore.engine.restore import apply, prepare

    states = _train(2)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App(dict(states[0]))}, run="r", step=0)
        snap = store.take({"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent")
        if not digests:
            forget_payload_digests(store)
        rows = {c.chunk_id: c for c in store.index.all_chunks()}
        delta = min((rows[c.id] for c in snap.manifest.entries["m/w"].chunks if rows[c.id].base_id),
                    key=lambda r: r.chunk_id)
        dest = {k: torch.zeros_like(v) for k, v in states[1].items()}
        reader = snap.reader()
        prepared = prepare(reader, {"m": App(dest)}, budget=0)  # nothing staged: all read again
        pack = Path(store.url) / ckstore.objects.pack_name(delta.pack_id)
        data = bytearray(pack.read_bytes())
        payload = delta.offset
        assert delta.codec == ckstore.objects.XOR_BYTEGROUP_ZSTD and data[payload + 1] == 4
        flag, length = struct.unpack_from("<BQ", data, payload + 2)  # plane 0 (low bytes) is stored
        assert flag == 0  # raw (its XOR bits are noise): a byte flipped there still decodes
        data[payload + 2 + 4 * 9 + length // 2] ^= 0x01
        pack.chmod(0o644)
        pack.write_bytes(bytes(data))
        why = "differs from the one its writer recorded" if digests else "changed after it was verified"
        with pytest.raises(ckstore.CorruptionError, match=why):
            apply(prepared, reader)
        for key, want in states[1].items():
            got = dest[key]
            assert bool(((got == want) | (got == 0)).all()), key


def test_check_read_data_is_clean_after_gc_leaves_dead_deltas_in_a_live_pack(tmp_path: Path) -> None:
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
        rows = {c.chunk_id: c for c in store.index.all_chunks()}
        delta_packs = {rows[cid].pack_id for cid in snap.manifest.chunk_ids() if rows[cid].base_id}
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        last = store.take({"m": App({"w": w, "k": kept})}, run="r", step=2, delta_base=None)
        store.gc(keep_last=1, grace_seconds=0, repack_below=0.0)
        assert delta_packs <= set(store.objects.list_packs())  # the dead deltas are still stored
        assert not any(c.base_id for c in store.index.all_chunks())
        report = store.check(read_data=True)
        assert report.ok, [p.message for p in report.problems]
        assert _restores(store, last.id, {"w": w, "k": kept})
