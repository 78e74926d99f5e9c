"""Huge pages for new memory a read fills: asked for only where the kernel's mode wants asking
and the pages are free, never for small buffers, and the memory reads back what was written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ckstore.objects import memory

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


def _fake_system(monkeypatch: pytest.MonkeyPatch, mode: str, free: int) -> list[int]:
    """A fresh budget reading ``mode`` and ``free`` bytes of huge pages; returns the list of
    times /proc/buddyinfo was read (appended to)."""
    reads: list[int] = []

    def read_text(path: str, parse: object) -> object:
        if path.endswith("enabled"):
            return memory.thp_mode(f"always [{mode}] never" if mode else "always madvise never")
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
    assert not memory._FREE.take(4 << 20)
    assert reads == []  # nor is /proc/buddyinfo read


def test_small_or_unaligned_ranges_are_not_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_system(monkeypatch, "madvise", 1 << 40)
    called: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_madvise", lambda a, n, how: called.append((a, n)) or True)
    assert not memory.advise_huge_pages(0, memory.HUGE_MIN_BYTES - 1)
    assert called == []
    # 4 MiB starting 1 byte past a huge page: only the one whole huge page inside is advised
    assert memory.advise_huge_pages(memory.HUGE_PAGE + 1, 4 << 20) is (sys.platform == "linux")
    if sys.platform == "linux":
        assert called == [(2 * memory.HUGE_PAGE, memory.HUGE_PAGE)]


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
def test_advised_memory_is_marked_for_huge_pages_and_holds_what_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_system(monkeypatch, "madvise", 1 << 40)
    n = 8 << 20
    m = memory.private_memory(n)
    try:
        address = memory.address_of(m)
        assert memory.advise_huge_pages(address, n)
        first_whole = -(-address // memory.HUGE_PAGE) * memory.HUGE_PAGE
        assert "hg" in _vm_flags(first_whole)
        m[:] = bytes(range(256)) * (n // 256)
        assert m[: 1 << 20] == bytes(range(256)) * 4096
        assert m[-256:] == bytes(range(256))
    finally:
        m.close()
