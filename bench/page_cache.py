"""What a cold read leaves in the page cache, and what it costs the warm restores after it.

The kernel reads a file into large folios (up to 2 MiB each) on a plain ``read`` or a page
fault, ramping up as a sequential stream goes on, but into 4 KiB pages on a
``posix_fadvise(WILLNEED)`` hint: the hints a cold restore of ckstore sends ahead of its
threads so the disk stays busy while they check (``engine/restore/readahead.py``). Mapping
and copying 4 KiB pages costs more per byte than large folios, so a warm restore of files a
cold restore brought in runs slower than one of the same files as written, until they leave
the page cache.

One ckstore store holds one snapshot of the benchmark state. For each way of bringing its
pack files into the page cache (after evicting them), each round records the read's seconds,
the share of the packs' pages then held in large folios (``/proc/kpageflags``: root only,
else n/a) and the median of ``--warm`` atomic restores after it:

* ``as taken``: the files as the take wrote them (evicted, then rewritten in 2 MiB writes,
  which is what a take's page cache holds: large folios);
* ``cold restore``: an atomic restore with its hints, the way a resume reads;
* ``cold restore, no hints``: the same with the hints switched off (a benchmark's patch):
  the threads' own faults then read ahead, in large folios, but the disk waits on them;
* ``sequential read``: every pack read start to end (``read``, 8 MiB at a time).

Ways rotate within each round. Prints medians over rounds and each warm restore's ratio to
``as taken``.

    python bench/page_cache.py                      # 270 MiB, 3 rounds
    python bench/page_cache.py --size-mb 1024 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckbench.states import build_state, empty_like_state, scramble  # noqa: E402
from ckbench.util import evict, sequential_read  # noqa: E402

import ckstore  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
_COMPOUND_HEAD, _COMPOUND_TAIL = 1 << 15, 1 << 16  # /proc/kpageflags bits


def _app(state: dict[str, Any]) -> dict[str, Any]:
    return {k: ckstore.StateDict(v) for k, v in state.items()}


def packs(root: Path) -> list[Path]:
    return sorted((root / "packs").rglob("*.pack"))


def large_folio_share(files: list[Path]) -> float | None:
    """The share of the files' pages held in large folios (each file mapped and touched once,
    then each page's frame looked up in ``/proc/self/pagemap`` and ``/proc/kpageflags``);
    None where those cannot be read (not root, not Linux)."""
    import mmap

    large = total = 0
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for path in files:
                size = path.stat().st_size
                if size == 0:
                    continue
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
                try:
                    a = np.frombuffer(m, dtype=np.uint8)
                    int(a[::PAGE].sum())  # map every page (they are cached: no read)
                    n = (size + PAGE - 1) // PAGE
                    pm.seek(a.ctypes.data // PAGE * 8)
                    frames = struct.unpack(f"{n}Q", pm.read(n * 8))
                    for entry in frames:
                        pfn = entry & ((1 << 55) - 1)
                        if pfn == 0:
                            return None  # frame numbers hidden: not root
                        kf.seek(pfn * 8)
                        (flags,) = struct.unpack("Q", kf.read(8))
                        large += bool(flags & (_COMPOUND_HEAD | _COMPOUND_TAIL))
                        total += 1
                    del a
                finally:
                    m.close()
    except OSError:
        return None
    return large / total if total else None


def rewrite(files: list[Path], block: int = 2 << 20) -> None:
    """Write each file anew in ``block``-byte writes, fsynced (the page cache a take leaves)."""
    for path in files:
        data = path.read_bytes()
        tmp = path.with_suffix(".rewrite")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for at in range(0, len(data), block):
                os.write(fd, data[at : at + block])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)


@contextmanager
def no_hints() -> Iterator[None]:
    """Restores inside send no read-ahead hints to the kernel (a benchmark's patch)."""
    from ckstore.objects.local import LocalBackend

    was = LocalBackend.prefetch
    LocalBackend.prefetch = lambda self, name, offset, length: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalBackend.prefetch = was  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=270)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=5, help="warm restores after each read")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    state = build_state(args.size_mb << 20, args.seed)
    work = Path(tempfile.mkdtemp(prefix="ckbench-cache-"))
    try:
        store = ckstore.open(work / "store", create=True)
        store.take(_app(state), run="bench")
        store.wait_compacted()
        files = packs(work / "store")
        dest = empty_like_state(state)

        def restore() -> None:
            store.get("bench").restore(_app(dest))

        def cold_no_hints() -> None:
            with no_hints():
                restore()

        ways: dict[str, Callable[[], Any]] = {
            "as taken": lambda: rewrite(files),
            "cold restore": restore,
            "cold restore, no hints": cold_no_hints,
            "sequential read": lambda: sequential_read(work / "store" / "packs"),
        }
        read: dict[str, list[float]] = {k: [] for k in ways}
        warm: dict[str, list[float]] = {k: [] for k in ways}
        share: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                evict(work / "store")
                scramble(dest)
                t0 = time.perf_counter()
                ways[name]()
                read[name].append(time.perf_counter() - t0)
                s = large_folio_share(files)
                if s is not None:
                    share[name].append(s)
                times = []
                for _ in range(args.warm):
                    scramble(dest)
                    t0 = time.perf_counter()
                    restore()
                    times.append(time.perf_counter() - t0)
                warm[name].append(statistics.median(times))
        base = statistics.median(warm["as taken"])
        print(
            f"a {args.size_mb} MiB snapshot's packs brought into the page cache {len(ways)} ways, "
            f"{args.rounds} rounds, medians ({os.cpu_count()} CPUs, threads={store.threads})"
        )
        print(
            f"{'':24s} {'read':>9s} {'large folios':>13s} {'warm restore':>13s} {'/ as taken':>11s}"
        )
        for k in ways:
            w = statistics.median(warm[k])
            sh = f"{statistics.median(share[k]):.0%}" if share[k] else "n/a"
            print(
                f"{k:24s} {statistics.median(read[k]) * 1e3:7.0f}ms {sh:>13s} "
                f"{w * 1e3:11.1f}ms {w / base:10.2f}x"
            )
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
