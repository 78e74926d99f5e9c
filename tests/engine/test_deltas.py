"""Deltas: chunks stored as the XOR of their bits against a base chunk, read through chains.

What a user relies on: every snapshot restores bit-exactly whatever the chain, no gc ever
leaves a chain unreadable, check and reindex see through deltas, and the bytes shrink.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.restore.reader import Reader
from ckstore.objects.delta import encode_delta, xor_into
from ckstore.objects.packs import DELTA_FORMAT_VERSION, FORMAT_VERSION, HEADER, load_pack_index
from tests.support.deltas import KNOBS, App, depths, restores, take_all, train
from tests.support.states import forget_payload_digests


# -- the codec ---------------------------------------------------------------------------------
def test_delta_round_trip_and_fallback() -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4096).astype(np.float32)
    new = base + np.float32(1e-4) * rng.standard_normal(4096).astype(np.float32)
    codec, payload = encode_delta(new.tobytes(), base.tobytes(), 4, True)
    assert codec == objects.XOR_BYTEGROUP_ZSTD
    _, plain = objects.encode(new.tobytes(), 4, True)
    assert len(payload) < 0.8 * len(plain)
    xor = bytearray(objects.decode(codec, payload, new.nbytes))
    xor_into(xor, base.tobytes())
    assert bytes(xor) == new.tobytes()
    # unrelated bytes: the delta does not pay, the chunk is encoded whole
    other = rng.standard_normal(4096).astype(np.float32)
    codec, payload = encode_delta(other.tobytes(), base.tobytes(), 4, True)
    assert not objects.is_delta(codec) and codec == objects.encode(other.tobytes(), 4, True)[0]
    with pytest.raises(ckstore.InvalidInputError, match="same length"):
        encode_delta(b"abcd", b"abc", 1, False)


def test_pack_is_version_2_only_when_it_holds_a_delta() -> None:
    backend = objects.memory_backend("packs-v2")
    store = objects.ObjectStore(backend)
    raw = bytes(range(256)) * 16
    base_id = objects.chunk_id(raw)
    w = store.new_pack_writer()
    w.add(base_id, "none", raw, len(raw))
    plain = w.finish()
    assert plain is not None
    assert (
        HEADER.unpack(backend.get(objects.pack_name(plain[0]), 0, HEADER.size))[1] == FORMAT_VERSION
    )

    new = bytearray(raw)
    new[5] ^= 0xFF
    codec, payload = encode_delta(bytes(new), raw, 1, False)
    assert codec == objects.XOR_ZSTD
    w = store.new_pack_writer()
    w.add(objects.chunk_id(bytes(new)), codec, payload, len(new), base_id)
    done = w.finish()
    assert done is not None
    pack_id, _, locs = done
    assert (
        HEADER.unpack(backend.get(objects.pack_name(pack_id), 0, HEADER.size))[1]
        == DELTA_FORMAT_VERSION
    )
    (loc,) = load_pack_index(backend, pack_id).locations
    assert loc.base_id == base_id and loc.codec == codec
    # a reader holding the chain decodes it; without the base it refuses, naming the base
    full = plain[2][0]
    chained = objects.ChunkLocation(
        loc.chunk_id, loc.pack_id, loc.offset, loc.length, loc.raw_length, loc.codec, base_id, full
    )
    assert bytes(store.read_chunk(chained)) == bytes(new)
    with pytest.raises(ckstore.CorruptionError, match=base_id):
        store.read_chunk(loc)
    # a delta without a base, or a base on a plain chunk, is refused when written
    w = store.new_pack_writer()
    with pytest.raises(ckstore.InvalidInputError):
        w.add(loc.chunk_id, codec, payload, len(new))
    with pytest.raises(ckstore.InvalidInputError):
        w.add(base_id, "none", raw, len(raw), loc.chunk_id)


# -- the store ---------------------------------------------------------------------------------
def test_parent_deltas_restore_every_snapshot_and_stay_within_the_depth_limit(
    tmp_path: Path,
) -> None:
    states = train(7)
    with ckstore.open(tmp_path / "delta", delta_depth=3, **KNOBS, create=True) as store:
        ids = take_all(store, states, delta_base="parent")
        delta_bytes = sum(store.get(i).stats["new_bytes"] for i in ids)
        chain = depths(store)
        assert max(chain) == 3 and chain.count(0) > 0
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert torch.equal(store.get(ids[-1]).read_object("m/w"), states[-1]["w"])
        assert store.check(read_data=True).ok
        codecs = {c.codec for c in store.repository.index.all_chunks()}
        assert {objects.XOR_BYTEGROUP_ZSTD} <= codecs
    with ckstore.open(tmp_path / "whole", **KNOBS, create=True) as store:
        ids = take_all(store, states)
        whole_bytes = sum(store.get(i).stats["new_bytes"] for i in ids)
        assert max(depths(store)) == 0
    assert delta_bytes < 0.8 * whole_bytes


def test_store_default_and_explicit_none(tmp_path: Path) -> None:
    states = train(3)
    with ckstore.open(tmp_path / "s", delta_base="parent", **KNOBS, create=True) as store:
        take_all(store, states[:2])
        assert max(depths(store)) == 1
        store.take({"m": App(dict(states[2]))}, run="r", step=2, delta_base=None)
        assert max(c.depth for c in store.repository.index.all_chunks()) == 1  # the third is whole
        with pytest.raises(ckstore.InvalidInputError, match="delta_depth"):
            store.delta_depth = 99
        with pytest.raises(ckstore.InvalidInputError, match="delta_base"):
            store.take({"m": App(dict(states[2]))}, delta_base="")  # type: ignore[arg-type]
        with pytest.raises(ckstore.SnapshotNotFoundError):
            store.take({"m": App(dict(states[2]))}, delta_base="no-such-ref")


def test_fine_tune_against_a_tagged_base_model(tmp_path: Path) -> None:
    base, tuned = train(1, seed=1)[0], {}
    g = torch.Generator().manual_seed(5)
    tuned = {
        k: (v + 1e-3 * torch.randn(v.shape, generator=g)).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in base.items()
    }
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App(dict(base))}, run="base", tags=["base-model"])
        snap = store.take({"m": App(dict(tuned))}, run="ft", delta_base="base-model")
        assert snap.parent_id is None  # the base is a delta source, not the run's parent
        assert restores(store, snap.id, tuned)
        assert any(c.base_id for c in store.repository.index.all_chunks())


def test_gc_never_leaves_a_chain_unreadable(tmp_path: Path) -> None:
    states = train(8)
    with ckstore.open(tmp_path / "s", delta_depth=4, **KNOBS, create=True) as store:
        ids = take_all(store, states, delta_base="parent")
        # forget all but the last two: their chains still need the older chunks
        report = store.gc(keep_last=2, grace_seconds=0, repack_below=1.0)
        assert report.snapshots_dropped
        for i, s in list(zip(ids, states))[-2:]:
            assert restores(store, i, s)
        assert store.check(read_data=True).ok
        kept = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        assert all(c.base_id in kept for c in kept.values() if c.base_id)
        # once every snapshot is gone, gc removes every chunk, chains included (rounds of pruning)
        for s in store.log():
            store.delete(s.id, force=True)
        store.gc(grace_seconds=0)
        assert list(store.repository.index.all_chunks()) == []
        assert store.repository.objects.list_packs() == []


def test_check_and_restore_see_a_damaged_base(tmp_path: Path) -> None:
    states = train(3)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        ids = take_all(store, states, delta_base="parent")
        rows = list(store.repository.index.all_chunks())
        delta = next(c for c in rows if c.base_id)
        root = {c.chunk_id: c for c in rows}[delta.base_id]
        while root.base_id:
            root = {c.chunk_id: c for c in rows}[root.base_id]
        path = Path(store.url) / objects.pack_name(root.pack_id)
        data = bytearray(path.read_bytes())
        data[root.offset + root.length // 2] ^= 0x01
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        report = store.check(read_data=True)
        assert not report.ok
        assert any(
            delta.chunk_id in p.message or root.chunk_id in p.message for p in report.problems
        )
        victim = next(i for i in ids if delta.chunk_id in store.get(i).manifest.chunk_ids())
        with pytest.raises(ckstore.CorruptionError, match="delta chain|damaged"):
            store.get(victim).restore(
                {"m": App({k: torch.zeros_like(v) for k, v in states[0].items()})}
            )


def test_reindex_rebuilds_delta_edges_and_depths(tmp_path: Path) -> None:
    states = train(5)
    path = tmp_path / "s"
    with ckstore.open(path, delta_depth=2, **KNOBS, create=True) as store:
        ids = take_all(store, states, delta_base="parent")
        before = {(c.chunk_id, c.base_id, c.depth) for c in store.repository.index.all_chunks()}
    for f in path.iterdir():
        if f.name.startswith("index.sqlite"):
            f.unlink()
    with ckstore.open(path, create=True) as store:
        report = store.reindex()
        assert report.snapshots == 5 and report.skipped == []
        assert {
            (c.chunk_id, c.base_id, c.depth) for c in store.repository.index.all_chunks()
        } == before
        for i, s in zip(ids, states):
            assert restores(store, i, s)
        assert store.check(read_data=True).ok


def test_du_and_diff_report_delta_savings(tmp_path: Path) -> None:
    from ckstore.history.du import du

    states = train(2)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        take_all(store, states[:1], run="whole")
        a, b = take_all(store, states, delta_base="parent")
        rows = {r.run: r for r in du(store.repository)}
        usage, total = rows["r"], rows[None]
        assert usage.delta_chunks > 0 and 0 < usage.delta_bytes < usage.delta_raw_bytes
        assert usage.delta_saved_bytes == usage.delta_raw_bytes - usage.delta_bytes
        assert rows["whole"].delta_chunks == 0 and total.delta_chunks == usage.delta_chunks
        d = store.diff(a, b, numeric=True)  # numeric diff reads both sides through the chains
        assert d.to_dict()["b_deltas"]["chunks"] > 0


def test_distributed_take_refuses_deltas_clearly(tmp_path: Path) -> None:
    from ckstore import _takes
    from ckstore.engine.take.spec import TakeSpec

    with pytest.raises(ckstore.InvalidInputError, match="distributed take"):
        _takes._no_dist_deltas(TakeSpec.of(run="r", delta_base="parent"))


def test_cli_import_of_a_fine_tune_against_its_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    from ckstore import cli

    g = torch.Generator().manual_seed(3)
    base = {
        "layer.weight": torch.randn(128, 256, generator=g),
        "layer.bias": torch.randn(256, generator=g),
    }
    tuned = {k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    store = str(tmp_path / "s")
    assert cli.main(["--store", store, "init"]) == 0
    assert (
        cli.main(
            [
                "--store",
                store,
                "import",
                str(tmp_path / "base.safetensors"),
                "--run",
                "base",
                "--tag",
                "base-model",
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "--store",
                store,
                "import",
                str(tmp_path / "tuned.safetensors"),
                "--run",
                "sft",
                "--delta-base",
                "base",
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli.main(["--store", store, "du"]) == 0
    assert "deltas in sft:" in capsys.readouterr().out
    assert cli.main(["--store", store, "diff", "base", "sft"]) == 0
    assert "are deltas" in capsys.readouterr().out
    with ckstore.open(store, create=True) as s:
        got = s.get("sft").read_object("model/layer.weight")
        assert torch.equal(got, tuned["layer.weight"])
        assert any(c.base_id for c in s.repository.index.all_chunks())
    # and out again, through the chains
    from safetensors.torch import load_file

    assert cli.main(["--store", store, "export", "sft", str(tmp_path / "out")]) == 0
    (exported,) = (tmp_path / "out").glob("*.safetensors")
    back = load_file(str(exported))
    assert all(torch.equal(back[k], v) for k, v in tuned.items())


def test_chains_on_every_deployment_survive_gc_and_repack(any_store: ckstore.Store) -> None:
    """Local, memory and S3 + PostgreSQL: the foreign key and the pruning rounds behave alike."""
    store = any_store
    store.delta_depth = 2
    states = train(6)
    ids = take_all(store, states, delta_base="parent")
    assert {c.depth for c in store.repository.index.all_chunks()} == {0, 1, 2}
    dry = store.gc(keep_last=1, grace_seconds=0, dry_run=True)
    report = store.gc(keep_last=1, grace_seconds=0, repack_below=1.0)
    assert report.chunks_removed == dry.chunks_removed > 0
    assert restores(store, ids[-1], states[-1])
    assert store.check(read_data=True).ok
    for s in store.log():
        store.delete(s.id, force=True)
    store.gc(grace_seconds=0)
    assert list(store.repository.index.all_chunks()) == []


def test_a_new_handle_verifies_bases_and_a_damaged_base_never_blocks_a_take(tmp_path: Path) -> None:
    states = train(4)
    path = tmp_path / "s"
    with ckstore.open(path, **KNOBS, create=True) as store:
        first = store.take({"m": App(dict(states[0]))}, run="r", step=0).id
    with ckstore.open(
        path, **KNOBS, create=True
    ) as store:  # nothing trusted yet: bases are read and verified
        second = store.take({"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent").id
        assert any(c.base_id for c in store.repository.index.all_chunks())
        third = store.take(
            {"m": App(dict(states[2]))}, run="r", step=2, delta_base="parent"
        ).id  # trusted
        for i, s in zip((first, second, third), states):
            assert restores(store, i, s)
    # damage one keyframe's payload: a new take stores the chunks against it whole, and says so
    with ckstore.open(path, **KNOBS, create=True) as store:
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        root = next(
            c
            for c in rows.values()
            if c.base_id is None and c.chunk_id in store.get(first).manifest.chunk_ids()
        )
        pack = Path(store.url) / objects.pack_name(root.pack_id)
        data = bytearray(pack.read_bytes())
        data[root.offset + root.length // 3] ^= 0x10
        pack.chmod(0o644)
        pack.write_bytes(bytes(data))
        snap = store.take({"m": App(dict(states[3]))}, run="r", step=3, delta_base=first)
        assert restores(store, snap.id, states[3])


@pytest.mark.parametrize(
    "codecs",
    [
        ("bytegroup", "xor-zstd", "xor-bytegroup-zstd"),
        ("none", "xor-bytegroup-zstd", "xor-zstd"),
        ("bytegroup", "xor-bytegroup-zstd", "xor-bytegroup-zstd"),
    ],
)
def test_chains_of_mixed_codecs_decode_and_verify(codecs: tuple[str, str, str]) -> None:
    """Whatever mix of codecs a (crafted or future) writer chains, readers get the right bytes."""
    from ckstore.objects.codecs import BYTEGROUP_ZSTD, ZSTD
    from ckstore.objects.codecs.bytegroup import encode_grouped

    rng = np.random.default_rng(7)
    v0 = (rng.standard_normal(2048) * 0.02).astype(np.float32)
    v1 = v0 + np.float32(1e-5) * rng.standard_normal(2048).astype(np.float32)
    v2 = v1 + np.float32(1e-5) * rng.standard_normal(2048).astype(np.float32)
    raws = [v.tobytes() for v in (v0, v1, v2)]

    def payload(codec: str, data: bytes) -> bytes:
        inner = objects.codecs.delta_inner(codec)
        if inner in (BYTEGROUP_ZSTD, "bytegroup"):
            return bytes(encode_grouped(memoryview(data), 4, 1, None))
        if inner == ZSTD:
            return objects.encode(data, 4, False)[1]  # type: ignore[return-value]
        return data

    store = objects.ObjectStore(objects.memory_backend())
    w = store.new_pack_writer()
    ids = [objects.chunk_id(r) for r in raws]
    root_codec = "bytegroup-zstd" if codecs[0] == "bytegroup" else "none"
    w.add(ids[0], root_codec, payload(root_codec, raws[0]), len(raws[0]))
    for k in (1, 2):
        xor = np.bitwise_xor(
            np.frombuffer(raws[k], np.uint8), np.frombuffer(raws[k - 1], np.uint8)
        ).tobytes()
        w.add(ids[k], codecs[k], payload(codecs[k], xor), len(xor), ids[k - 1])
    done = w.finish()
    assert done is not None
    locs = {loc.chunk_id: loc for loc in done[2]}
    import dataclasses

    l1 = dataclasses.replace(locs[ids[1]], base=locs[ids[0]])
    l2 = dataclasses.replace(locs[ids[2]], base=l1)
    assert bytes(store.read_chunk(l2)) == raws[2]
    fp = store.verify_chunk(l2, fingerprint_it=True)
    out = bytearray(len(raws[2]))
    store.load_verified(l2, memoryview(out), fp, None)  # type: ignore[arg-type]
    assert bytes(out) == raws[2]


def test_a_trusted_base_whose_pack_is_gone_never_blocks_a_take(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bases of a training loop's next take are trusted (read or written by this handle):
    a base pack lost meanwhile (a gc beside with no grace, a damaged store) must make the
    take store those chunks whole, as for an untrusted base, not fail it."""
    states = train(3)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App(dict(states[0]))}, run="r", step=0)
        first_packs = {c.pack_id for c in store.repository.index.all_chunks()}
        store.take(
            {"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent"
        )  # trusts the bases
        for pack_id in first_packs:
            store.repository.objects.delete_pack(pack_id)
        snap = store.take({"m": App(dict(states[2]))}, run="r", step=2, delta_base="parent")
        assert "storing the chunk whole" in caplog.text
        assert restores(store, snap.id, states[2])


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "no-digests"])
def test_a_delta_payload_that_changes_between_the_restore_passes_is_never_decoded_into_place(
    tmp_path: Path, digests: bool
) -> None:
    """The second pass of a restore checks a chunk's payloads (against fingerprints taken in
    the first pass) *before* decoding into the caller's tensor (docs/RELIABILITY.md, I3): a
    delta's chain too, so a payload changed between the passes leaves that chunk's elements
    untouched, never wrong."""
    from ckstore.engine.restore.phases import apply, prepare

    states = train(2)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take({"m": App(dict(states[0]))}, run="r", step=0)
        snap = store.take({"m": App(dict(states[1]))}, run="r", step=1, delta_base="parent")
        if not digests:
            forget_payload_digests(store)
        rows = {c.chunk_id: c for c in store.repository.index.all_chunks()}
        delta = min(
            (rows[c.id] for c in snap.manifest.entries["m/w"].chunks if rows[c.id].base_id),
            key=lambda r: r.chunk_id,
        )
        dest = {k: torch.zeros_like(v) for k, v in states[1].items()}
        reader = Reader.of(snap.view)
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
        # checked by the chunk's check in the first pass, with its digests or without: the
        # second refuses a payload that is not the one checked
        with pytest.raises(ckstore.CorruptionError, match="changed after it was verified"):
            apply(prepared, reader)
        for key, want in states[1].items():
            got = dest[key]
            assert bool(((got == want) | (got == 0)).all()), key
