"""Bytes a restore reads from storage, counted at the backend boundary (``CountingBackend``).

An atomic restore checks every chunk before it touches the destination, then puts them in
place: two passes over the payloads. On a store where reading again means fetching again (S3),
the first pass keeps a copy of each payload in a spill file (``StashingBackend``) and the
second reads the copy: every restore, atomic included, reads the stored bytes once.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.objects import wrappers
from tests.support.paths import REPO

KNOBS = {"chunk_bytes": 16 << 10, "pack_bytes": 128 << 10, "inline_bytes": 64}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(256, 512, generator=g),
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 9, (128, 128), generator=g),
    }


@pytest.fixture
def s3_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    server: Any = request.getfixturevalue("s3_server")
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    store = ckstore.open(
        f"s3://{bucket}/ckpts",
        index=f"sqlite:///{tmp_path / 'index.sqlite'}",
        storage_options=server.storage_options(),
        create=True,
        **KNOBS,
    )
    yield store
    store.close()


def _counted(store: ckstore.Store) -> objects.CountingBackend:
    counting = objects.CountingBackend(store.repository.objects.backend)
    store.repository.objects = objects.ObjectStore(counting)
    return counting


def _pack_bytes(counting: objects.CountingBackend) -> int:
    return sum(g.nbytes for g in counting.gets if g.name.startswith("packs/"))


def _restore(store: ckstore.Store, ref: str, **kw: Any) -> dict[str, torch.Tensor]:
    want = _state()
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    store.get(ref).restore({"m": ckstore.StateDict(dest)}, **kw)
    assert all(torch.equal(dest[k], v) for k, v in want.items())
    return dest


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streamed"])
def test_every_restore_reads_the_stored_bytes_once_from_s3(
    s3_store: ckstore.Store, atomic: bool
) -> None:
    snap = s3_store.take({"m": ckstore.StateDict(_state())}, run="r")
    stored = sum(
        c.length
        for c in s3_store.repository.index.all_chunks()
        if c.chunk_id in snap.manifest.chunk_ids()
    )
    counting = _counted(s3_store)
    assert not counting.cached_locally
    _restore(
        s3_store, "r", atomic=atomic, memory_budget=0
    )  # nothing staged: every payload read twice by the passes
    assert stored <= _pack_bytes(counting) <= 1.05 * stored, (_pack_bytes(counting), stored)


def test_a_spill_disk_that_fills_up_only_costs_a_second_read(
    s3_store: ckstore.Store, monkeypatch
) -> None:
    snap = s3_store.take({"m": ckstore.StateDict(_state())}, run="r")
    stored = sum(
        c.length
        for c in s3_store.repository.index.all_chunks()
        if c.chunk_id in snap.manifest.chunk_ids()
    )
    counting = _counted(s3_store)

    def full(*args: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wrappers.os, "pwrite", full)
    _restore(s3_store, "r", memory_budget=0)
    assert 1.9 * stored <= _pack_bytes(counting) <= 2.05 * stored  # read again, right all the same


def test_the_stash_serves_a_range_once_kept_and_leaves_the_store_open(tmp_path) -> None:
    inner = objects.CountingBackend(objects.memory_backend())
    inner.put("packs/ab/x.pack", bytes(range(256)) * 64)
    stash = objects.StashingBackend(inner, str(tmp_path))
    for _ in range(3):
        out = memoryview(bytearray(100))
        stash.get_into("packs/ab/x.pack", 1000, out)
        assert bytes(out) == (bytes(range(256)) * 64)[1000:1100]
    assert stash.get("packs/ab/x.pack", 1000, 100) == (bytes(range(256)) * 64)[1000:1100]
    assert inner.get_calls == 1 and stash.hits == 3
    stash.close()
    assert inner.get("packs/ab/x.pack", 0, 4) == bytes(
        range(4)
    )  # the store's backend is still open
    assert list(tmp_path.iterdir()) == []  # the spill file had no name to begin with


def _hints(monkeypatch: pytest.MonkeyPatch, window: int) -> list[tuple[str, int]]:
    """The (pack, offset) of every prefetch hint a local store sends from now on, its device
    reading ``window`` bytes ahead on its own."""
    hinted: list[tuple[str, int]] = []
    real = objects.LocalBackend.prefetch

    def prefetch(self: Any, name: str, offset: int, length: int) -> None:
        hinted.append((name, offset))
        real(self, name, offset, length)

    monkeypatch.setattr(objects.LocalBackend, "prefetch", prefetch)
    monkeypatch.setattr(objects.LocalBackend, "read_ahead", lambda self: window)
    return hinted


@pytest.mark.parametrize("atomic", [True, False])
def test_a_local_restore_reads_each_payload_once_in_pack_order_hinted_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """On a local store every payload is one view of its mapped pack, read once; the kernel is
    told about each (the threads take them in pack order, front to back) where it reads
    little ahead on its own (128 KiB, the common default)."""
    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    snap = store.take({"m": ckstore.StateDict(_state())}, run="r")
    counting = _counted(store)
    hinted = _hints(monkeypatch, 128 << 10)
    _restore(store, "r", atomic=atomic, memory_budget=0)
    reads = [(g.name, g.offset) for g in counting.gets if g.name.startswith("packs/")]
    assert len(set(reads)) == len(reads)  # once each
    assert len(reads) == len(snap.manifest.chunk_ids())
    assert sorted(hinted) == sorted(reads)
    store.close()


def test_where_the_kernel_reads_far_ahead_of_faults_the_check_through_mappings_sends_no_hints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hinted range comes into the page cache in 4 KiB pages, which every later warm read
    of it maps and copies more slowly than the large folios a fault reads ahead into
    (``bench/page_cache.py``). Where the device reads 1 MiB or more ahead of a fault on its
    own, an atomic restore's check, which faults its payloads in through mappings, leaves the
    read-ahead to the kernel; a restore that reads into place still hints every payload."""
    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    store.take({"m": ckstore.StateDict(_state())}, run="r")
    counting = _counted(store)
    hinted = _hints(monkeypatch, 8 << 20)
    _restore(store, "r", atomic=True, memory_budget=0)
    assert hinted == []
    assert any(g.name.startswith("packs/") for g in counting.gets)  # read all the same
    counting.reset()
    _restore(store, "r", atomic=False)
    reads = [(g.name, g.offset) for g in counting.gets if g.name.startswith("packs/")]
    assert reads and sorted(hinted) == sorted(reads)
    store.close()


@pytest.mark.parametrize("how", ["restore(atomic=False)", "read_object"])
def test_a_one_pass_read_of_raw_chunks_on_a_local_store_reads_them_into_place_unmapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A chunk stored raw that has a destination is read straight into it, not through a
    mapping of its pack: mapping costs a fault per page and a TLB shootdown when the pages go
    back (a warm 270 MiB restore(atomic=False) on 2 cores: 59 ms mapped, 42 ms read). A chunk
    the read damaged on its way is still found by the check."""
    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    store.take({"m": ckstore.StateDict(_state())}, run="r")
    calls = {"view": 0, "get_into_each": 0}
    for verb in calls:
        real = getattr(objects.LocalBackend, verb)

        def counted(self: Any, *args: Any, _real: Any = real, _verb: str = verb) -> Any:
            calls[_verb] += 1
            return _real(self, *args)

        monkeypatch.setattr(objects.LocalBackend, verb, counted)
    if how == "read_object":
        got = store.get("r").read_object("m/w")
        assert torch.equal(got, _state()["w"])
    else:
        _restore(store, "r", atomic=False)
    assert calls["view"] == 0 and calls["get_into_each"] > 0, calls

    real_into = objects.LocalBackend.get_into_each

    def flipped(self: Any, name: str, offset: int, out: memoryview, each: Any) -> None:
        def damaged(piece: memoryview) -> None:  # a bit flipped on its way, before the check
            view = memoryview(piece).cast("B")
            view[len(view) // 2] ^= 0x10
            each(piece)

        real_into(self, name, offset, out, damaged)

    monkeypatch.setattr(objects.LocalBackend, "get_into_each", flipped)
    with pytest.raises(ckstore.CorruptionError, match="check"):
        if how == "read_object":
            store.get("r").read_object("m/w")
        else:
            _restore(store, "r", atomic=False)
    store.close()


@pytest.mark.parametrize("then", ["kept", "replaced", "deleted"])
def test_an_atomic_restore_puts_raw_chunks_in_place_from_the_very_packs_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The second pass of an atomic restore reads a raw chunk again from the pack its first
    pass checked through a mapping, not by copying the mapping (which maps each page in again):
    while the pack at its path is that file. A pack another file was renamed over between
    the passes, or one deleted, gives the bytes that were checked, out of the mapping (which
    keeps them), never the other file's."""
    from ckstore.engine.restore.phases import apply, prepare
    from ckstore.engine.restore.reader import Reader
    from ckstore.objects import mapping

    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    store.take({"m": ckstore.StateDict(_state())}, run="r")
    assert {r.codec for r in store.repository.index.all_chunks()} == {objects.NONE}
    reads = {"again": 0}
    real = mapping.Mappings.read_into

    def counted(self: Any, view: memoryview, out: memoryview) -> bool:
        done = real(self, view, out)
        reads["again"] += done
        return done

    monkeypatch.setattr(mapping.Mappings, "read_into", counted)
    want = _state()
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    app = {"m": ckstore.StateDict(dest)}
    reader = Reader.of(store.get("r").view)
    prepared = prepare(reader, app, budget=0)
    backend = store.repository.objects.backend
    packs = [backend._path(objects.pack_name(p)) for p in store.repository.objects.list_packs()]  # type: ignore[attr-defined]
    assert packs
    for path in packs:
        if then == "replaced":
            other = bytearray(Path(path).read_bytes())
            other[40:-40] = bytes(len(other) - 80)  # the same length, other payloads
            Path(path + ".new").write_bytes(other)
            os.replace(path + ".new", path)
        elif then == "deleted":
            os.unlink(path)
    apply(prepared, reader)
    assert all(torch.equal(dest[k], v) for k, v in want.items())
    raw = sum(1 for r in store.repository.index.all_chunks() if r.length > KNOBS["inline_bytes"])
    assert reads["again"] == (raw if then == "kept" else 0)
    store.close()


def test_a_single_process_resume_does_not_load_the_distributed_restore(tmp_path: Path) -> None:
    """A fresh process that opens a store and restores pays for the modules it runs: the
    distributed restore (its exchange, read plans and communicator: 13 modules, 10-40 ms of a
    resume here) is loaded only under torch.distributed."""
    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    store.take({"m": ckstore.StateDict(_state())}, run="r")
    store.close()
    script = (
        "import sys, torch, ckstore\n"
        f"store = ckstore.open({str(tmp_path / 's')!r})\n"
        "state = {'w': torch.zeros(256, 512), 'b': torch.zeros(4096, dtype=torch.bfloat16)}\n"
        "store.get('r').restore({'m': ckstore.StateDict(state)})\n"
        "assert bool(state['w'].abs().sum() > 0)\n"
        "print(sorted(m for m in sys.modules if m.startswith('ckstore.distributed.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    ).stdout
    loaded = ast.literal_eval(out.strip().splitlines()[-1])
    assert "ckstore.distributed.restore" not in loaded, loaded
    assert "ckstore.distributed.comm" not in loaded, loaded


def test_a_raw_chunk_read_into_a_buffer_takes_any_shape_of_its_bytes_and_refuses_a_wrong_one(
    tmp_path: Path,
) -> None:
    """The caller's buffer is checked as the decoders check it: a view of the right bytes in
    any format or shape is filled; one of another size, or read-only, is the caller's mistake
    (``InvalidInputError``), never reported as damage in storage (which would start a heal)."""
    import numpy as np

    from ckstore.engine.locations import to_location

    store = ckstore.open(tmp_path / "s", create=True, **KNOBS)
    store.take({"m": ckstore.StateDict(_state())}, run="r")
    repo = store.repository
    rows = repo.index.chunk_locations(repo.index.snapshot_chunk_ids(store.get("r").id))
    rec = next(r for r in rows.values() if r.codec == "none" and r.base_id is None)
    loc = to_location(rec, rows)
    want = bytes(repo.objects.read_chunk(loc))
    floats = np.zeros(loc.raw_length // 4, dtype=np.float32)
    repo.objects.read_chunk(loc, memoryview(floats))
    assert floats.tobytes() == want
    square = np.zeros((2, loc.raw_length // 2), dtype=np.uint8)
    repo.objects.read_chunk(loc, memoryview(square))
    assert square.tobytes() == want
    with pytest.raises(ckstore.InvalidInputError, match="bytes"):
        repo.objects.read_chunk(loc, memoryview(bytearray(loc.raw_length - 8)))
    with pytest.raises(ckstore.InvalidInputError, match="read-only"):
        repo.objects.read_chunk(loc, memoryview(bytes(loc.raw_length)))
    store.close()
