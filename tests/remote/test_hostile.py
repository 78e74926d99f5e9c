"""A remote is another party: what it says about its own bytes proves nothing.

A pull, a clone and bringing evicted chunks back (hydrate) read payloads from another store.
That store's index supplies each payload's digest (an unkeyed checksum), so a damaged or hostile
remote can file any bytes under any chunk id with a digest that matches. Those bytes must be
refused before this store records them: later takes dedup against what this store holds, and a
chunk recorded with the wrong bytes would make them unrestorable. One damaged chunk fails only
the snapshots that need it; the others arrive.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from sqlalchemy import update

import ckstore
from ckstore import errors, objects
from ckstore.engine.locations import to_location
from ckstore.index import _sql
from ckstore.objects.hashing import payload_digest
from ckstore.remote.tier import refresh
from tests.support.remotes import app, restores, state_for


def _only_in(store: ckstore.Store, ref: str) -> list[str]:
    """Chunk ids of ``ref`` that no other snapshot of the store uses, sorted."""
    index = store.repository.index
    mine = index.snapshot_chunk_ids(store.get(ref).id)
    others: set[str] = set()
    for s in store.log():
        if s.id != store.get(ref).id:
            others |= index.snapshot_chunk_ids(s.id)
    return sorted(mine - others)


def _pair(store: ckstore.Store, ref: str) -> tuple[str, str]:
    """Two whole chunks only ``ref`` uses, of one raw length: a victim and a decoy."""
    ids = _only_in(store, ref)
    rows = store.repository.index.chunk_locations(ids)
    by_length: dict[int, list[str]] = {}
    for cid in ids:
        if rows[cid].base_id is None:
            by_length.setdefault(rows[cid].raw_length, []).append(cid)
    victim, decoy = next(v for v in by_length.values() if len(v) >= 2)[:2]
    return victim, decoy


def _forge(store: ckstore.Store, chunk_id: str, **values: Any) -> None:
    """Rewrite a chunk's row in the store's index (what a hostile remote's owner can do)."""
    with store.repository.index._write("forge a row") as conn:
        conn.execute(update(_sql.chunks).where(_sql.chunks.c.id == chunk_id).values(**values))


def _forge_pack(
    store: ckstore.Store, chunk_id: str, codec: str, payload: bytes, raw: int, base: str | None
) -> None:
    """Write ``payload`` into a new pack of the store and point ``chunk_id``'s row at it, with a
    payload digest that matches (as a hostile remote would)."""
    repo = store.repository
    writer = repo.objects.new_pack_writer(repo.config.pack_bytes)
    writer.add(chunk_id, codec, payload, raw, base)
    done = writer.finish()
    assert done is not None
    pack_id, size, locs = done
    with repo.index._write("forge a pack") as conn:
        _sql.insert_ignore(
            conn,
            _sql.packs,
            [
                {
                    "id": pack_id,
                    "size": size,
                    "chunk_count": 1,
                    "created_at": time.time(),
                    "loose": False,
                }
            ],
        )
    _forge(
        store,
        chunk_id,
        pack_id=pack_id,
        offset=locs[0].offset,
        length=locs[0].length,
        codec=codec,
        base_id=base,
        depth=0 if base is None else 1,
        payload_digest=payload_digest(payload, chunk_id, codec, raw, base),
    )


def test_a_pull_refuses_bytes_the_remote_files_under_another_chunks_id(source, tmp_path) -> None:
    """The remote's row for a chunk of r@1 points at another chunk's payload, with a digest
    recomputed to match. Before: the pull recorded those bytes under that id, and a later take
    of the real state deduped against them and could never be restored."""
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.open(tmp_path / "remote") as remote:
        victim, other = _pair(remote, "r@1")
        o = remote.repository.index.chunk_locations([other])[other]
        payload = remote.repository.objects.backend.get(
            objects.pack_name(o.pack_id), o.offset, o.length
        )
        _forge(
            remote,
            victim,
            pack_id=o.pack_id,
            offset=o.offset,
            length=o.length,
            codec=o.codec,
            payload_digest=payload_digest(payload, victim, o.codec, o.raw_length),
        )
    with ckstore.open(tmp_path / "mine", create=True) as mine:
        mine.add_remote("origin", tmp_path / "remote")
        with pytest.raises(errors.CorruptionError) as err:
            mine.pull("origin")
        assert victim in str(err.value) and "r@1" in str(err.value)
        assert victim not in mine.repository.index.chunk_locations([victim])
        assert sorted(s.step for s in mine.log()) == [2, 3, 10]  # the others arrived
        mine.take(app(1), run="mine", step=1)  # holds the real bytes of that chunk
        assert restores(mine, "mine", 1) and all(restores(mine, f"r@{i}", i) for i in (2, 3))
        assert mine.check(read_data=True).ok


def test_a_pulled_delta_is_decoded_onto_this_stores_base(source, tmp_path) -> None:
    """The remote stores a chunk of r@2 as a delta against a chunk of r@1 that this store holds,
    and forges both: its base row points at other bytes, and the delta is computed against
    those, so the pair decodes right *there* and every digest matches. Decoded onto this
    store's own (right) copy of the base, the delta gives other bytes: refused."""
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.open(tmp_path / "mine", create=True) as mine:
        mine.add_remote("origin", tmp_path / "remote")
        mine.pull("origin", ["r@1"])
    with ckstore.open(tmp_path / "remote") as remote:
        index, store = remote.repository.index, remote.repository.objects
        m1, m2 = (remote.repository.load_manifest(remote.get(r).record) for r in ("r@1", "r@2"))
        base_id, chunk_id = m1.entries["m/drift"].chunks[0].id, m2.entries["m/drift"].chunks[0].id
        decoy = m1.entries["m/fresh"].chunks[0].id
        rows = index.chunk_locations([base_id, chunk_id, decoy])
        assert base_id != chunk_id and rows[decoy].raw_length == rows[base_id].raw_length
        raw = bytes(store.read_chunk(to_location(rows[chunk_id], rows)))
        fake_base = bytes(store.read_chunk(to_location(rows[decoy], rows)))
        d = rows[decoy]
        fake_payload = store.backend.get(objects.pack_name(d.pack_id), d.offset, d.length)
        _forge(
            remote,
            base_id,
            pack_id=d.pack_id,
            offset=d.offset,
            length=d.length,
            codec=d.codec,
            payload_digest=payload_digest(fake_payload, base_id, d.codec, d.raw_length),
        )
        xor = bytes(a ^ b for a, b in zip(raw, fake_base))
        _forge_pack(
            remote,
            chunk_id,
            "xor-zstd",
            zstandard.ZstdCompressor().compress(xor),
            len(raw),
            base_id,
        )
        assert restores(remote, "r@2", 2)  # the forged pair decodes right there
    with ckstore.open(tmp_path / "mine") as mine:
        with pytest.raises(errors.CorruptionError) as err:
            mine.pull("origin", ["r@2"])
        assert chunk_id in str(err.value)
        assert [s.step for s in mine.log()] == [1] and mine.check(read_data=True).ok
        mine.take(app(2), run="mine", step=2)
        assert restores(mine, "mine", 2)


def test_one_damaged_chunk_fails_only_the_snapshots_that_need_it(source, tmp_path) -> None:
    """A pull of everything, and a clone, with one chunk of r@1 damaged at the remote: r@2, r@3
    and s arrive with their tags; the error names r@1 and the chunk."""
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin")
    with ckstore.open(tmp_path / "remote") as remote:
        cid = _only_in(remote, "r@1")[0]
        rec = remote.repository.index.chunk_locations([cid])[cid]
    pack = tmp_path / "remote" / objects.pack_name(rec.pack_id)
    data = bytearray(pack.read_bytes())
    data[rec.offset + rec.length // 2] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    with ckstore.open(tmp_path / "mine", create=True) as mine:
        mine.add_remote("origin", tmp_path / "remote")
        with pytest.raises(errors.CorruptionError) as err:
            mine.pull("origin")
        message = str(err.value)
        assert "r@1" in message and cid in message and "3 other(s) were committed" in message
        assert sorted(s.step for s in mine.log()) == [2, 3, 10] and mine.tags()["best"]
        assert all(restores(mine, f"r@{i}", i) for i in (2, 3)) and mine.check(read_data=True).ok
    with pytest.raises(errors.CorruptionError, match="r@1"):
        ckstore.clone(tmp_path / "remote", tmp_path / "copy")
    with ckstore.open(tmp_path / "copy") as copy:
        assert sorted(s.step for s in copy.log()) == [2, 3, 10] and restores(copy, "s", 10)


def test_hydrate_refuses_bytes_the_remote_forged(tmp_path: Path) -> None:
    """Chunks evicted to the tier remote, whose row there is then forged (another chunk's
    payload, a matching digest): hydrate refuses them and they stay evicted; a restore of that
    snapshot fails before touching anything, and none of the forged digests reached this
    store's rows."""
    remote_dir = tmp_path / "remote"
    knobs = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
    with ckstore.open(
        tmp_path / "local", create=True, push_to=str(remote_dir), local_budget=0, **knobs
    ) as s:
        for step in (1, 2):
            s.take(app(step), run="r", step=step)
        assert s.wait_pushed(timeout=60)
        s.take(app(3), run="r", step=3)  # a round after the pushes: evicts what they sent
        assert s.wait_pushed(timeout=60)
        index = s.repository.index
        evicted = index.chunks_in_packs(index.remote_pack_ids())
        assert evicted and all(r.payload_digest is None for r in evicted)
    with ckstore.open(remote_dir) as remote:
        victim, other = _pair(remote, "r@1")
        o = remote.repository.index.chunk_locations([other])[other]
        payload = remote.repository.objects.backend.get(
            objects.pack_name(o.pack_id), o.offset, o.length
        )
        _forge(
            remote,
            victim,
            pack_id=o.pack_id,
            offset=o.offset,
            length=o.length,
            codec=o.codec,
            payload_digest=payload_digest(payload, victim, o.codec, o.raw_length),
        )
    with ckstore.open(tmp_path / "local") as local, ckstore.open(remote_dir) as remote:
        row = local.repository.index.chunk_locations([victim])[victim]
        assert row.pack_id in local.repository.index.remote_pack_ids()
        # the remote "repacked": this store's rows of that pack follow the remote's rows
        refresh(local.repository, remote.repository, "tier", row.pack_id)
        now = local.repository.index.chunk_locations([victim])[victim]
        assert (now.pack_id, now.offset, now.payload_digest) == (o.pack_id, o.offset, None)
        with pytest.raises(errors.CorruptionError, match=victim):
            local.hydrate()
        assert local.repository.index.chunk_locations([victim])[victim].pack_id == o.pack_id
        local.memory_budget = 1  # past the budget an atomic restore checks payloads first
        want = state_for(1)
        out = {"m": ckstore.StateDict({k: torch.zeros_like(v) for k, v in want.items()})}
        with pytest.raises(errors.CorruptionError):
            local.get("r@1").restore(out)
        assert all(not v.any() for v in out["m"].values())  # nothing was loaded
