"""Payload digests (index revision 0003): what the writer records, and how an atomic restore
uses them to check stored bytes without decoding them twice (docs/RELIABILITY.md, I3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import text

import ckstore
from ckstore import objects
from ckstore.objects import chunk_reader
from ckstore.objects.hashing import is_payload_digest, payload_digest
from tests.support.states import forget_payload_digests

KNOBS: dict[str, Any] = {"chunk_bytes": 4096, "inline_bytes": 64, "take_codec": "dense"}
"""Dense takes: these tests pick byte-grouped chunks (the fast codec's are checked alike)."""


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 64, generator=g),
        "b": torch.randn(300, generator=g).to(torch.bfloat16),
    }


def _app(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"m": ckstore.StateDict(dict(state))}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _payload(store: ckstore.Store, rec: Any) -> bytes:
    return bytes(
        store.repository.objects.backend.get(objects.pack_name(rec.pack_id), rec.offset, rec.length)
    )


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = chunk_reader.decode_hashed

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_reader, "decode_hashed", counting)
    return calls


@pytest.mark.parametrize("take_codec", ["fast", "dense"])
def test_every_chunk_a_take_writes_has_the_digest_of_its_stored_payload(
    tmp_path: Path, take_codec: str
) -> None:
    with ckstore.open(tmp_path / "s", **{**KNOBS, "take_codec": take_codec}, create=True) as store:
        store.take(_app(_state()), run="r")
        rows = list(store.repository.index.all_chunks())
        assert len(rows) > 4
        for rec in rows:
            assert is_payload_digest(rec.payload_digest)
            assert rec.payload_digest == payload_digest(
                _payload(store, rec), rec.chunk_id, rec.codec, rec.raw_length, rec.base_id
            )


def test_the_digest_binds_what_decoding_depends_on() -> None:
    cid, base = "ab" * 32, "cd" * 32
    one = payload_digest(b"payload", cid, "zstd", 100)
    assert one == payload_digest(bytearray(b"payload"), cid, "zstd", 100)
    others = {
        payload_digest(b"payloae", cid, "zstd", 100),
        payload_digest(b"payload", "ef" * 32, "zstd", 100),
        payload_digest(b"payload", cid, "bytegroup-zstd", 100),
        payload_digest(b"payload", cid, "zstd", 101),
        payload_digest(b"payload", cid, "zstd", 100, base),
    }
    assert one not in others and len(others) == 5


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "no-digests"])
def test_atomic_restore_by_id_past_its_budget_decodes_each_chunk_once_with_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digests: bool
) -> None:
    """Verifying by id (``verify="full"``), with digests the first pass reads payloads
    undecoded; without them (a store written before revision 0003) it decodes every chunk to
    verify it, and the second pass decodes each again. By the chunks' checks (the default),
    the first pass decodes every chunk it does not stage, so a decoder that errs is found
    before anything is touched (tests/engine/test_checks.py). Either way the result is exact."""
    src = _state()
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        snap = store.take(_app(src), run="r")
        if not digests:
            forget_payload_digests(store)
        n = len(snap.manifest.chunk_ids())
        calls = _count_decodes(monkeypatch)
        dest = _zeros(src)
        store.get("r").restore(_app(dest), memory_budget=0, verify="full")
        assert all(torch.equal(dest[k], src[k]) for k in src)
        assert calls[0] == (n if digests else 2 * n)
        calls[0] = 0
        store.get("r").restore(
            _app(_zeros(src)), verify="full"
        )  # the default budget stages some: still once each at most
        assert calls[0] <= (n if digests else 2 * n)
        calls[0] = 0
        dest = _zeros(src)
        store.get("r").restore(_app(dest), memory_budget=0)
        assert all(torch.equal(dest[k], src[k]) for k in src)
        assert calls[0] == 2 * n


@pytest.mark.parametrize(
    ("verify", "why"),
    [
        (False, "does not match its check|cannot be decoded"),
        ("full", "differs from the one its writer recorded"),
    ],
)
def test_a_damaged_payload_is_found_before_anything_is_touched(
    tmp_path: Path, verify: Any, why: str
) -> None:
    src = _state()
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take(_app(src), run="r")
        rec = max(
            store.repository.index.all_chunks(), key=lambda r: r.offset
        )  # the last payload of its pack
        path = Path(store.url) / objects.pack_name(rec.pack_id)
        data = bytearray(path.read_bytes())
        data[rec.offset + rec.length - 1] ^= 0x40
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        dest = _zeros(src)
        with pytest.raises(ckstore.CorruptionError, match=why) as err:
            store.get("r").restore(_app(dest), memory_budget=0, verify=verify)
        assert "nothing was restored" in str(err.value)
        assert all(not t.any() for t in dest.values())
        report = store.check(read_data=True)
        assert rec.chunk_id in {p.object for p in report.problems}


@pytest.mark.parametrize(
    ("column", "value"),
    [("codec", "'zstd'"), ("raw_length", "raw_length + 4"), ("base_id", "id")],
)
@pytest.mark.parametrize("verify", [False, "full"])
def test_a_damaged_index_row_is_found_before_anything_is_touched(
    tmp_path: Path, column: str, value: str, verify: Any
) -> None:
    """The digest binds the row's id, codec, raw length and base to the payload, so a row
    that would decode the right payload wrongly is refused in the first pass; the check does
    the same by decoding."""
    src = _state()
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take(_app(src), run="r")
        rec = next(r for r in store.repository.index.all_chunks() if r.codec == "bytegroup-zstd")
        with store.repository.index._engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(
                text(f"UPDATE chunks SET {column} = {value} WHERE id = :id"), {"id": rec.chunk_id}
            )
        dest = _zeros(src)
        with pytest.raises(ckstore.CorruptionError):
            store.get("r").restore(_app(dest), memory_budget=0, verify=verify)
        assert all(not t.any() for t in dest.values())


def test_a_payload_its_writer_encoded_wrong_is_still_caught_by_the_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest only shows the payload is the one written. A writer that stored a wrong
    encoding (a bug, or memory flipped before the write) has a right digest for it. The
    chunk's check refuses it in the first pass, nothing touched; verifying by id, the digest
    passes and the id check of the second pass refuses the chunk, saying the destination may
    be partly loaded. check --read-data finds it too."""
    real = objects.encode

    def wrong(
        raw: Any,
        itemsize: int,
        grouped: bool,
        level: int = 1,
        buffer: Any = None,
        fast: bool = False,
    ) -> Any:
        bad = bytearray(memoryview(raw).cast("B"))
        bad[0] ^= 0x01
        return real(bytes(bad), itemsize, grouped, level, fast=fast)

    src = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        with monkeypatch.context() as m:
            m.setattr(objects, "encode", wrong)
            store.take(_app(src), run="r")
        dest = _zeros(src)
        with pytest.raises(ckstore.CorruptionError, match="does not match its check"):
            store.get("r").restore(_app(dest), memory_budget=0)
        assert all(not t.any() for t in dest.values())
        with pytest.raises(
            ckstore.CorruptionError, match="writer stored a wrong encoding.*partly loaded"
        ):
            store.get("r").restore(_app(dest), memory_budget=0, verify="full")
        with pytest.raises(ckstore.CorruptionError, match="does not match its check"):
            store.get("r").read_object("m/w")
        assert "corrupt-chunk" in {p.kind for p in store.check(read_data=True).problems}


def test_a_wrong_digest_in_the_index_is_reported_by_check_and_atomic_false_still_reads(
    tmp_path: Path,
) -> None:
    src = _state()
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take(_app(src), run="r")
        rec = next(iter(store.repository.index.all_chunks()))
        with store.repository.index._engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(
                text("UPDATE chunks SET payload_digest = :d WHERE id = :id"),
                {"d": "0" * 32, "id": rec.chunk_id},
            )
        problems = store.check(read_data=True).problems
        assert [(p.kind, p.object) for p in problems] == [("payload-digest", rec.chunk_id)]
        with pytest.raises(ckstore.CorruptionError):
            store.get("r").restore(_app(_zeros(src)), memory_budget=0, verify="full")
        for kw in ({"atomic": False}, {"memory_budget": 0}):  # the checks never ask the digest
            dest = _zeros(src)
            store.get("r").restore(_app(dest), **kw)  # type: ignore[arg-type]
            assert all(torch.equal(dest[k], src[k]) for k in src)


def test_repack_and_delta_chains_keep_digests_that_restores_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks a repack moves get the digest of their new place; a delta's chain is checked
    link by link; no restore past the budget decodes a chunk twice."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    keep, drop = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    states = []
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take(
            _app({"keep": keep, "drop": drop}), run="mix"
        )  # one pack, half of it dropped below
        store.take(_app({"keep": keep}), run="solo")
        for step in range(3):
            w = w + 1e-3 * torch.randn(w.shape, generator=g)
            states.append({"w": w.clone()})
            store.take(_app(states[-1]), run="r", step=step, delta_base="parent")
        store.delete("mix")
        report = store.gc(grace_seconds=0, repack_below=1.0)
        assert report.packs_rewritten >= 1
        rows = list(store.repository.index.all_chunks())
        assert any(r.base_id for r in rows)
        for rec in rows:
            assert rec.payload_digest == payload_digest(
                _payload(store, rec), rec.chunk_id, rec.codec, rec.raw_length, rec.base_id
            )
        calls = _count_decodes(monkeypatch)
        dest = {"keep": torch.zeros_like(keep)}
        store.get("solo").restore(_app(dest), memory_budget=0, verify="full")
        assert torch.equal(dest["keep"], keep)
        n = len(store.get("solo").manifest.chunk_ids())
        for step in (1, 2):
            dest = _zeros(states[step])
            store.get(f"r@{step}").restore(_app(dest), memory_budget=0, verify="full")
            assert torch.equal(dest["w"], states[step]["w"])
        assert calls[0] == n  # byte-grouped chains decode through their planes, none twice
        assert store.check(read_data=True).ok
