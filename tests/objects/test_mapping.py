"""Mapped views of a local store's files: the hints a restore gives the kernel about them.

A restore touches each payload through a read-only mapping and gives the pages back after use
(``Mappings.drop``), in batches; it tells the kernel which ranges come next
(``mapping.prefetch``) unless they are in the page cache already.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ckstore.objects import mapping
from ckstore.objects.local import LocalBackend
from ckstore.objects.mapping import DROP_BATCH, Mappings

MiB = 1 << 20

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/smaps and RWF_NOWAIT (Linux)"
)


def _file(path: Path, size: int) -> Path:
    path.write_bytes(np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes())
    return path


def _resident(address: int) -> int:
    """Bytes of the mapping that starts at ``address`` that this process has mapped in."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
                inside = start == address
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@linux_only
def test_dropped_ranges_go_back_once_a_batch_gathered(tmp_path: Path) -> None:
    size = 2 * DROP_BATCH + 8 * MiB
    path = str(_file(tmp_path / "pack", size))
    maps = Mappings()
    view = maps.view(path, 0, size)
    pages = np.frombuffer(view, dtype=np.uint8)
    int(pages[:: mapping.mmap.PAGESIZE].sum())  # every page mapped in
    address = pages.__array_interface__["data"][0]
    assert _resident(address) == size

    for at in range(0, DROP_BATCH - MiB, MiB):  # less than a batch: still mapped
        maps.drop(path, at, MiB)
    assert _resident(address) == size

    maps.drop(path, DROP_BATCH - MiB, MiB)  # a batch: given back at once
    assert _resident(address) == size - DROP_BATCH

    maps.drop(path, size - 4 * MiB, 4 * MiB)  # a new range, less than a batch: kept
    assert _resident(address) == size - DROP_BATCH
    maps.drop(path, DROP_BATCH, DROP_BATCH)  # gathered with it: all of it goes
    assert _resident(address) == 0

    assert bytes(view[:64]) == open(path, "rb").read(64)  # touched again: mapped again
    del pages, view


@linux_only
def test_ranges_not_given_back_stay_under_one_batch_over_all_files(tmp_path: Path) -> None:
    """A restore reads chunks from several packs at once: what stays mapped is bounded over
    all of them, not per file (a bound per file let a 270 MiB restore over 5 packs keep 50 MiB
    mapped, and its peak resident memory pass the 10% of the state it is allowed)."""
    part, files = 4 * MiB, 2 * DROP_BATCH // (4 * MiB)  # each file's share: under one batch
    maps = Mappings()
    touched = []
    for i in range(files):
        path = str(_file(tmp_path / f"pack{i}", part))
        view = maps.view(path, 0, part)
        pages = np.frombuffer(view, dtype=np.uint8)
        int(pages[:: mapping.mmap.PAGESIZE].sum())  # every page mapped in
        touched.append((pages.__array_interface__["data"][0], view, pages))
        maps.drop(path, 0, part)
        assert sum(_resident(address) for address, _, _ in touched) < DROP_BATCH
    assert all(
        bytes(view[:64]) == open(tmp_path / f"pack{i}", "rb").read(64)
        for i, (_, view, _) in enumerate(touched)
    )  # touched again: mapped again
    del touched, view, pages


def _hints(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The ranges ``posix_fadvise(WILLNEED)`` is called with from now on (the calls still go
    through)."""
    hints: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return hints


@linux_only
def test_a_range_in_the_page_cache_is_not_hinted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path / "pack", 4 * MiB)
    hints = _hints(monkeypatch)
    path.read_bytes()  # in the page cache
    mapping.prefetch(str(path), MiB, 2 * MiB)
    assert hints == []


@pytest.mark.parametrize("cached", [(), ("first",), ("last",)])
def test_a_range_with_an_end_out_of_the_page_cache_is_hinted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: tuple[str, ...]
) -> None:
    """The kernel's own answer for a range out of the cache cannot be pinned down here: the
    probe that misses starts the kernel's read-ahead there, and a fast disk may have the pages
    in before the next look (see ``mapping.in_page_cache``; an uncached file written with direct
    I/O still read as cached in 1 run of 15 on this machine). So the probe answers as told."""
    path = _file(tmp_path / "pack", 4 * MiB)
    ends = {MiB: "first", 3 * MiB - 1: "last"}
    probed: list[int] = []

    def probe(fd: int, offset: int) -> bool:
        probed.append(offset)
        return ends[offset] in cached

    monkeypatch.setattr(mapping, "in_page_cache", probe)
    hints = _hints(monkeypatch)
    mapping.prefetch(str(path), MiB, 2 * MiB)
    assert hints == [(MiB, 2 * MiB)]
    assert probed and set(probed) <= set(ends)


def _sysfs(root: Path, dev: int, kind: str, kib: str) -> None:
    """A fake ``/sys`` under ``root`` where the device ``dev`` is ``kind``: a whole disk, a
    partition of one, or a device known only as a backing device (NFS)."""
    ident = f"{os.major(dev)}:{os.minor(dev)}"
    (root / "dev" / "block").mkdir(parents=True)
    if kind == "bdi only":
        entry = root / "class" / "bdi" / ident
        entry.mkdir(parents=True)
        (entry / "read_ahead_kb").write_text(kib)
        return
    disk = root / "devices" / "virtio0" / "block" / "vda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text(kib)
    target = disk
    if kind == "partition":
        target = disk / "vda1"
        target.mkdir()
        (target / "partition").write_text("1\n")
    (root / "dev" / "block" / ident).symlink_to(target)


@pytest.mark.parametrize("kind", ["disk", "partition", "bdi only"])
def test_the_read_ahead_window_is_the_one_of_the_disk_holding_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``read_ahead_window`` follows the file's device number to its disk (a partition's
    window is its disk's), or to its backing device where it is no block device, and answers
    0 where none can be told or the value makes no sense."""
    path = _file(tmp_path / "pack", 4096)
    sys_root = tmp_path / "sys"
    monkeypatch.setattr(mapping, "SYS", str(sys_root))
    assert mapping.read_ahead_window(str(path)) == 0  # no such device listed
    _sysfs(sys_root, os.stat(path).st_dev, kind, "8192\n")
    assert mapping.read_ahead_window(str(path)) == 8 << 20
    assert mapping.read_ahead_window(str(tmp_path)) == 8 << 20  # a directory: its device
    assert mapping.read_ahead_window(str(tmp_path / "missing")) == 0
    for f in sys_root.rglob("read_ahead_kb"):
        f.write_text("many\n")
    assert mapping.read_ahead_window(str(path)) == 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@linux_only
def test_a_view_is_read_again_from_its_file_only_while_the_file_is_the_one_mapped(
    tmp_path: Path,
) -> None:
    """``read_into`` reads a view's bytes from its file while the path still holds the file
    mapped, unchanged; once it was replaced or deleted it reads nothing (the caller copies the
    view, whose mapping keeps the old bytes), and a backend's ``read_view_into`` gives the
    bytes that were mapped either way, never those of another file at the path."""
    backend = LocalBackend(str(tmp_path))
    path = _file(tmp_path / "pack", 4 * MiB)
    old = path.read_bytes()
    want = old[MiB + 3 : 3 * MiB + 3]
    maps = backend._maps
    view = backend.view("pack", MiB + 3, 2 * MiB)
    out = bytearray(2 * MiB)
    before = _fds()
    assert maps.read_into(view, memoryview(out))
    assert bytes(out) == want
    assert _fds() == before  # nothing left open

    replaced = tmp_path / "new"
    replaced.write_bytes(bytes(4 * MiB))  # zeros, renamed over the pack
    os.replace(replaced, path)
    out[:] = bytes(2 * MiB)
    assert not maps.read_into(view, memoryview(out))
    backend.read_view_into(view, memoryview(out))
    assert bytes(out) == want

    path.unlink()
    assert not maps.read_into(view, memoryview(out))
    out[:] = bytes(2 * MiB)
    backend.read_view_into(view, memoryview(out))
    assert bytes(out) == want

    assert not maps.read_into(view, memoryview(bytearray(MiB)))  # another length
    assert not maps.read_into(memoryview(old)[:MiB], memoryview(bytearray(MiB)))  # no mapping
    assert _fds() == before
