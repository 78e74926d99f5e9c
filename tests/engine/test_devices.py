"""Device paths of take and restore: bounded host pools and asynchronous copies, exercised on CPU
with a copier whose copies finish late on another thread (the CUDA copier's behaviour), plus the
same round trips on a real GPU when one is present."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.engine import devices
from ckstore.engine.devices import Copier, HostPool
from ckstore.engine.restore.reader import Reader
from ckstore.objects import chunk_reader, memory


class _LateTransfer:
    def __init__(self) -> None:
        self.event = threading.Event()

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()


class LateCopier(Copier):
    """Copies on a background thread after a delay, reading the source only then: a buffer
    reused before its transfer completed would show up as wrong bytes."""

    def __init__(self, delay: float = 0.003) -> None:
        self.delay = delay
        self.buffers = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self.buffers += 1
        return super().host_buffer(nbytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> _LateTransfer:
        transfer = _LateTransfer()
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

        def run() -> None:
            time.sleep(self.delay)
            with torch.no_grad():
                dst.copy_(src)
            with self._lock:
                self.in_flight -= 1
            transfer.event.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        with self._lock:
            self._threads.append(t)
        return transfer

    def finish(self) -> None:
        for t in list(self._threads):
            t.join()


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> LateCopier:
    """Route CPU tensors through the device paths, with one late copier for all of them."""
    copier = LateCopier()
    monkeypatch.setattr(devices, "DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(devices, "copier_for", lambda t: copier)
    return copier


def test_pool_is_bounded_and_reuses_a_buffer_only_after_its_transfer() -> None:
    copier = LateCopier(delay=0.02)
    pool = HostPool(copier, 16, 2)
    a, b = pool.acquire(), pool.acquire()
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    pool.release(a, copier.copy(dst, a))  # dst <- a, later
    pool.release(b)
    again = pool.acquire()
    assert again is b  # the free one, not the one still being read
    t0 = time.perf_counter()
    third = pool.acquire()  # only `a` is left: waits for its transfer
    assert third is a and time.perf_counter() - t0 > 0.005
    assert copier.buffers == 2 and pool.nbytes == 32 and pool.peak_in_use == 2
    a.copy_(src)
    pool.release(third)
    pool.release(again)
    copier.finish()


def _state(seed: int = 0) -> dict[str, ckstore.StateDict]:
    g = torch.Generator().manual_seed(seed)
    return {
        "m": ckstore.StateDict(
            w=torch.randn(64, 48, generator=g),
            b=torch.randn(300, generator=g),
            h=torch.randn(40, 40, generator=g).to(torch.bfloat16),
            step=7,
        )
    }


def _zeros_like(state: dict[str, ckstore.StateDict]) -> dict[str, ckstore.StateDict]:
    return {
        "m": ckstore.StateDict(
            {
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                for k, v in state["m"].items()
            }
        )
    }


def test_take_stages_device_chunks_through_a_bounded_pool(
    store: ckstore.Store, late: LateCopier, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.engine.take import device_staging as device_stage

    monkeypatch.setattr(device_stage, "DEVICE_STAGING_BYTES", 4 * store.config.chunk_bytes)
    src = _state()
    snap = store.take(src, run="r")
    assert late.max_in_flight > 1  # copies were in flight while earlier chunks were hashed
    assert late.buffers <= 4  # the pool never grew past DEVICE_STAGING_BYTES
    monkeypatch.setattr(devices, "DEVICE_TYPES", frozenset())
    dest = _zeros_like(src)
    snap.restore(dest)
    for k in ("w", "b", "h"):
        assert torch.equal(dest["m"][k], src["m"][k])
    assert store.check(read_data=True).ok


@pytest.mark.parametrize(
    ("budget", "atomic"), [(None, True), (0, True), (1 << 30, True), (None, False)]
)
def test_restore_into_device_destinations_goes_through_host_buffers(
    store: ckstore.Store, late: LateCopier, budget: int | None, atomic: bool
) -> None:
    src = _state(1)
    store.take(src, run="r")  # a take through the device path too
    dest = _zeros_like(src)
    ptrs = {k: v.data_ptr() for k, v in dest["m"].items() if isinstance(v, torch.Tensor)}
    late.buffers = 0
    store.get("r").restore(dest, memory_budget=budget, atomic=atomic)
    for k, p in ptrs.items():
        assert torch.equal(dest["m"][k], src["m"][k]) and dest["m"][k].data_ptr() == p
    assert dest["m"]["step"] == 7
    threads = store.threads
    assert late.buffers <= 2 * threads + (1 if budget else 0)  # the pools, and at most one arena


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("mapped", "changed after it was verified"),  # its views kept, the pack written since
        ("read again", "changed after it was verified"),  # a payload fingerprint kept
        ("by id", "changed after it was verified"),  # digests compared, the views kept
    ],
)
def test_a_payload_that_changes_between_the_passes_is_refused(
    store: ckstore.Store, how: str, why: str
) -> None:
    from ckstore import objects
    from ckstore.engine.restore.phases import apply, prepare

    src = _state(2)
    snap = store.take(src, run="r")
    backend = store.repository.objects.backend
    if how == "read again":  # a backend that does not map its objects
        store.repository.objects = objects.ObjectStore(objects.FaultyBackend(backend))
    dest = _zeros_like(src)
    reader = Reader.of(store.get("r").view, verify="full" if how == "by id" else "fast")
    prepared = prepare(reader, dest, budget=0)  # nothing staged
    assert all(
        torch.count_nonzero(v) == 0 for v in dest["m"].values() if isinstance(v, torch.Tensor)
    )
    pack = next(iter(store.repository.objects.list_packs()))
    path = backend._path(ckstore.objects.pack_name(pack))  # type: ignore[attr-defined]
    data = bytearray(open(path, "rb").read())
    data[40] ^= 0xFF  # inside the first payload
    time.sleep(0.02)  # a file's times tick with the kernel's clock, not the nanosecond
    with open(path, "wb") as f:  # in place: the same file, written
        f.write(data)
    with pytest.raises(ckstore.CorruptionError, match=f"{why}.*partly loaded"):
        apply(prepared, reader)
    assert snap.id


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read again"])
def test_the_arena_keeps_what_fits_the_budget_and_only_the_rest_is_read_again(
    store: ckstore.Store, mapped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compressed chunks that fit the budget are decoded once, into the arena. The others are
    read once where the store maps its packs (the checked views are kept), else again."""
    from ckstore import objects

    src = {"m": ckstore.StateDict(w=torch.randn(64, 64))}  # 16 chunks of 1 KiB
    store.take_codec = "fast"  # compressed chunks: what the arena is for
    snap = store.take(src, run="r")
    assert {r.codec for r in store.repository.index.all_chunks()} == {objects.EXP_ZSTD}
    backend = store.repository.objects.backend
    counting = objects.CountingBackend(backend if mapped else objects.FaultyBackend(backend))
    store.repository.objects = objects.ObjectStore(counting)
    calls = [0]
    real = chunk_reader.decode_hashed

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_reader, "decode_hashed", counted)
    dest = {"m": ckstore.StateDict(w=torch.zeros(64, 64))}
    store.get("r").restore(dest, memory_budget=5 * 1024)
    assert torch.equal(dest["m"]["w"], src["m"]["w"])
    reads = sum(1 for g in counting.gets if g.name.startswith("packs/"))
    assert reads == (16 if mapped else 16 + (16 - 5))
    assert calls[0] == 16 + (16 - 5)  # the arena's 5 once, the others in both passes
    assert len(snap.manifest.chunk_ids()) == 16


class _Free:
    """A huge-page budget that always says yes (2 MiB pages)."""

    def huge_page(self) -> int:
        return 2 << 20

    def take(self, n: int) -> bool:
        return True


def test_new_tensors_a_read_fills_sit_on_huge_pages_of_their_own_and_read_back_exactly(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_object's new tensors come from ``host_empty``: a large one in a mapping of its own
    that starts on a huge page and is advised (never heap memory a later allocation reuses),
    a small one as before."""
    asked: list[int] = []
    real = memory.huge_memory
    monkeypatch.setattr(memory, "_FREE", _Free())
    monkeypatch.setattr(devices, "huge_memory", lambda n: asked.append(n) or real(n))
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB
    small = torch.randn(1000, generator=g)
    with ckstore.open(tmp_path / "s", create=True) as s:
        s.take({"m": ckstore.StateDict({"big": big, "small": small})}, run="r", step=0)
        got = s.get("r@0").read_object("m/big")
        assert torch.equal(got, big)
        assert asked == [big.numel() * 4]
        if sys.platform == "linux":
            assert got.data_ptr() % (2 << 20) == 0
            flags, name = _mapping_of(got.data_ptr())
            assert name != "[heap]" and ("hg" in flags or not _THP.exists())
        assert torch.equal(s.get("r@0").read_object("m/small"), small)
        assert len(asked) == 1
    t = devices.host_empty((2, 3), torch.bfloat16)
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and t.is_contiguous()


_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> tuple[list[str], str]:
    """The VmFlags and the name of this process's mapping holding ``address``."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = block.split("\n", 1)[0].split()
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        if lo <= address < hi:
            m = re.search(r"^VmFlags:(.*)$", block, re.M)
            return (m.group(1).split() if m else []), (head[5] if len(head) > 5 else "")
    raise AssertionError(f"no mapping holds {address:#x}")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("atomic", [True, False])
def test_cuda_take_and_restore_round_trip(tmp_path, atomic: bool) -> None:
    store = ckstore.open(tmp_path / "s", chunk_bytes=1 << 16, create=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = {
        "m": ckstore.StateDict(
            w=torch.randn(1024, 256, device="cuda", generator=g),
            h=torch.randn(300, 7, device="cuda", generator=g).to(torch.bfloat16),
        )
    }
    snap = store.take(src, run="r")
    dest = {
        "m": ckstore.StateDict(
            w=torch.zeros(1024, 256, device="cuda"),
            h=torch.zeros(300, 7, device="cuda", dtype=torch.bfloat16),
        )
    }
    snap.restore(dest, atomic=atomic)
    assert torch.equal(dest["m"]["w"], src["m"]["w"]) and torch.equal(dest["m"]["h"], src["m"]["h"])
    assert dest["m"]["w"].is_cuda
    store.close()


@cuda
def test_cuda_copier_uses_pinned_buffers() -> None:
    copier = devices.copier_for(torch.zeros(1, device="cuda"))
    assert copier.pinned and copier.host_buffer(16).is_pinned()


@cuda
def test_async_take_of_a_gpu_state_copies_into_pinned_memory_and_holds_the_state_of_the_call(
    tmp_path,
) -> None:
    """The copies from the GPU go into a pinned arena, issued at once and waited for before the
    call returns: kernels launched right after it cannot reach the snapshot. The next async
    take reuses the arena; a CPU state gets a pageable one."""
    store = ckstore.open(tmp_path / "s", chunk_bytes=1 << 16, create=True, auto_compact=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(2048, 512, device="cuda", generator=g)
    h = torch.randn(300, 7, device="cuda", generator=g).to(torch.bfloat16)
    app = {"m": ckstore.StateDict(w=w, h=h, cpu=torch.arange(100.0))}
    want = {k: v.clone() for k, v in app["m"].items()}
    pending = store.async_take(app, run="r", step=1)
    w.mul_(3.0)  # on the current stream, after the copies were issued
    h.zero_()
    snap = pending.wait(60)
    arena = store.repository._staging
    assert arena is not None and arena.pinned
    for key, value in want.items():
        assert torch.equal(snap.read_object(f"m/{key}").to(value.device), value), key
    again = store.async_take(app, run="r", step=2).wait(60)
    assert store.repository._staging is arena
    assert torch.equal(again.read_object("m/w").cuda(), w)
    cpu_only = store.async_take({"m": ckstore.StateDict(x=torch.ones(1000))}, run="c").wait(60)
    assert cpu_only.read_object("m/x").sum() == 1000 and not store.repository._staging.pinned
    store.close()
