"""Huge pages for new memory a read fills: asked for only where the kernel's mode wants asking
and the pages are free, never for small buffers, and the memory reads back what was written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ckstore.objects import memory
from tests.support.forking import fork_and_run

BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32    311    280    221    151    105     57     23     13     12      9    736
Node 0, zone   Normal 166920  93919  60328  24625   8917   6447   3206   1469   1718    651   1378
"""


def test_the_selected_mode_is_the_bracketed_word() -> None:
    assert memory.thp_mode("always [madvise] never\n") == "madvise"
    assert memory.thp_mode("[always] madvise never") == "always"
    assert memory.thp_mode("always madvise never") is None


def test_free_huge_bytes_counts_blocks_of_2_mib_and_up_outside_dma() -> None:
    mib = 1 << 20
    dma32 = 9 * 2 * mib + 736 * 4 * mib
    normal = 651 * 2 * mib + 1378 * 4 * mib
    assert memory.free_huge_bytes(BUDDYINFO) == dma32 + normal
    assert memory.free_huge_bytes("") == 0
    assert memory.free_huge_bytes("Node 0, zone Normal 5 5 5") == 0  # no block that large


def test_free_huge_bytes_counts_in_the_page_sizes_given() -> None:
    """With 64 KiB base pages a huge page is 512 MiB (order 13): blocks of orders 9-12 (32-256
    MiB) hold none, where counting in 4 KiB pages would see 340 MiB free."""
    info = "Node 0, zone   Normal 0 0 0 0 0 0 0 0 0 1 1 1 1 0"
    assert memory.free_huge_bytes(info, page=64 << 10, huge=512 << 20) == 0
    assert memory.free_huge_bytes(info) == (2 + 4 + 8 + 16) << 20
    info13 = info[: -len(" 0")] + " 2"
    assert memory.free_huge_bytes(info13, page=64 << 10, huge=512 << 20) == 2 * (512 << 20)


def _fake_system(
    monkeypatch: pytest.MonkeyPatch, mode: str, free: int, huge: int = 2 << 20
) -> list[int]:
    """A fresh budget reading ``mode``, a huge page of ``huge`` bytes and ``free`` bytes of
    them; returns the list of times /proc/buddyinfo was read (appended to)."""
    reads: list[int] = []

    def read_text(path: str, parse: object) -> object:
        if path.endswith("enabled"):
            return memory.thp_mode(f"always [{mode}] never" if mode else "always madvise never")
        if path.endswith("hpage_pmd_size"):
            return huge
        reads.append(1)
        return free

    monkeypatch.setattr(memory, "_read_text", read_text)
    monkeypatch.setattr(memory, "_FREE", memory._FreeHugePages())
    return reads


def test_a_process_asks_for_at_most_its_share_of_the_free_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _fake_system(monkeypatch, "madvise", 100 << 20)
    free = memory._FREE
    assert free.take(40 << 20)  # half of 100 MiB may be asked for
    assert not free.take(20 << 20)  # 10 MiB left of that half
    assert free.take(10 << 20)
    assert len(reads) == 1  # one reading serves the calls within its age
    free._read_at -= memory.BUDDYINFO_MAX_AGE_S + 1
    assert free.take(20 << 20)  # read again: a fresh share
    assert len(reads) == 2


@pytest.mark.parametrize("mode", ["always", "never", ""])
def test_nothing_is_asked_where_the_mode_is_not_madvise(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    reads = _fake_system(monkeypatch, mode, 1 << 40)
    assert memory.huge_memory(64 << 20) is None
    assert reads == []  # nor is /proc/buddyinfo read


def test_small_buffers_and_ones_below_a_huge_page_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _fake_system(monkeypatch, "madvise", 1 << 40, huge=32 << 20)  # 16 KiB-page arm64
    assert memory.huge_memory(memory.HUGE_MIN_BYTES - 1) is None
    assert memory.huge_memory(16 << 20) is None  # under one 32 MiB huge page
    assert reads == []


def test_no_advice_when_the_huge_pages_are_not_free(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_system(monkeypatch, "madvise", 6 << 20)  # half of it: one 2 MiB page may be asked for
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_madvise", lambda a, n, how: advised.append((a, n)) or True)
    assert memory.huge_memory(8 << 20) is None
    assert advised == []


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping holding ``address``."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= address < hi:
            m = re.search(r"^VmFlags:(.*)$", block, re.M)
            return m.group(1).split() if m else []
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="the kernel has no transparent huge pages (not Linux, or built without them)",
)
def test_the_buffer_starts_on_a_huge_page_in_its_own_advised_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_system(monkeypatch, "madvise", 1 << 40)
    advised: list[tuple[int, int]] = []
    real = memory._madvise
    monkeypatch.setattr(
        memory, "_madvise", lambda a, n, how: advised.append((a, n)) or real(a, n, how)
    )
    n = (5 << 20) + 123
    got = memory.huge_memory(n)
    assert got is not None
    mem, start = got
    try:
        base = memory.address_of(mem)
        assert (base + start) % (2 << 20) == 0 and start + n <= len(mem)
        assert advised == [(base, start + (4 << 20))]  # up to the n bytes' last whole huge page
        assert "hg" in _vm_flags(base + start)
        mem[start : start + n] = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
        assert mem[start : start + 256] == bytes(range(256))
        assert mem[start + n - 3 : start + n] == bytes(range(n % 256))[-3:]
    finally:
        mem.close()


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux only")
def test_a_child_forked_while_the_budget_is_read_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread reading /proc/buddyinfo at the fork holds the budget's lock: the child
    gets a budget (and lock) of its own, so its first large read does not wait forever."""
    _fake_system(monkeypatch, "madvise", 1 << 40)
    with memory._FREE._lock:  # what that thread holds at the fork
        fate = fork_and_run(lambda: memory.huge_memory(8 << 20) is not None, deadline_s=5)
    assert fate == "ok"
