"""What a cold read leaves in the page cache, and what it costs the warm restores after it.

The kernel reads a file into large folios (up to 2 MiB each) on a plain ``read`` or a page
fault, ramping up as a sequential stream goes on, but into 4 KiB pages on a
``posix_fadvise(WILLNEED)`` hint, which a cold restore of ckstore sends ahead of its threads
so the disk stays busy while they check (``engine/restore/readahead.py``; not in the check
through mappings where the disk reads 1 MiB or more ahead of a fault on its own). Mapping and
copying 4 KiB pages costs more per byte than large folios, so a warm restore of files a hinted
cold restore brought in runs slower than one of the same files as written, until they leave
the page cache.

One ckstore store holds one snapshot of the benchmark state. For each way of bringing its
pack files into the page cache (after evicting them), each round records the seconds that
took (for ``as taken``, the take), the share of the packs' pages then held in large folios
(``/proc/kpageflags``: root only, else n/a) and the median of ``--warm`` atomic restores
after it:

* ``as taken``: the files as a take writes them (the snapshot taken anew into a new store);
* ``cold restore``: an atomic restore, the way a resume reads (hinted or not as ckstore
  decides for this disk);
* ``cold restore, hinted``: the same with every payload hinted (a benchmark's patch: the
  disk taken to read nothing ahead on its own);
* ``cold restore, no hints``: the same with no hints at all (a benchmark's patch);
* ``sequential read``: every pack read start to end (``read``, 8 MiB at a time).

Ways rotate within each round. Prints medians over rounds and each warm restore's ratio to
``as taken``. The disk's read-ahead window is its ``queue/read_ahead_kb`` in sysfs.

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
    """The share of the files' cached pages held in large folios: each page found in the page
    cache (a read that may not wait) is touched through a mapping, which maps it without
    reading anything, and its frame looked up in ``/proc/self/pagemap`` and
    ``/proc/kpageflags``; pages not cached are left alone, so measuring brings nothing in.
    None where frames cannot be read (not Linux; hidden from a process without
    ``CAP_SYS_ADMIN``)."""
    import mmap

    from ckstore.objects.mapping import in_page_cache

    large = total = 0
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for path in files:
                size = path.stat().st_size
                if size == 0:
                    continue
                with open(path, "rb") as f:
                    cached = [p for p in range(0, size, PAGE) if in_page_cache(f.fileno(), p)]
                    m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
                a = np.frombuffer(m, dtype=np.uint8)
                try:
                    for p in cached:
                        int(a[p])  # maps the cached page
                    n = (size + PAGE - 1) // PAGE
                    pm.seek(a.ctypes.data // PAGE * 8)
                    frames = struct.unpack(f"{n}Q", pm.read(n * 8))
                finally:
                    del a
                    m.close()
                for p in cached:
                    entry = frames[p // PAGE]
                    pfn = entry & ((1 << 55) - 1)
                    if not entry >> 63:  # not present after all (reclaimed meanwhile)
                        continue
                    if pfn == 0:
                        return None  # frame numbers hidden
                    kf.seek(pfn * 8)
                    (flags,) = struct.unpack("Q", kf.read(8))
                    large += bool(flags & (_COMPOUND_HEAD | _COMPOUND_TAIL))
                    total += 1
    except OSError:
        return None
    return large / total if total else None


@contextmanager
def patched(method: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Restores inside run with ``LocalBackend.<method>`` replaced (a benchmark's patch)."""
    from ckstore.objects.local import LocalBackend

    was = getattr(LocalBackend, method)
    setattr(LocalBackend, method, replacement)
    try:
        yield
    finally:
        setattr(LocalBackend, method, was)


def no_hints() -> Any:
    """Restores inside send no read-ahead hints to the kernel."""
    return patched("prefetch", lambda self, name, offset, length: None)


def hints_forced() -> Any:
    """Restores inside send their read-ahead hints whatever the disk's read-ahead window (the
    device taken to read nothing ahead on its own)."""
    return patched("read_ahead", lambda self: 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=270)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warm", type=lambda v: max(1, int(v)), default=5, help="warm restores after each read"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    state = build_state(args.size_mb << 20, args.seed)
    work = Path(tempfile.mkdtemp(prefix="ckbench-cache-"))
    held: list[ckstore.Store] = []
    try:
        dest = empty_like_state(state)

        def take() -> None:  # the snapshot anew, in a new store
            while held:
                held.pop().close()
            shutil.rmtree(work / "store", ignore_errors=True)
            held.append(ckstore.open(work / "store", create=True))
            held[0].take(_app(state), run="bench")
            held[0].wait_compacted()

        def restore() -> None:
            held[0].get("bench").restore(_app(dest))

        def cold_no_hints() -> None:
            with no_hints():
                restore()

        def cold_hinted() -> None:
            with hints_forced():
                restore()

        ways: dict[str, Callable[[], Any]] = {
            "as taken": take,
            "cold restore": restore,
            "cold restore, hinted": cold_hinted,
            "cold restore, no hints": cold_no_hints,
            "sequential read": lambda: sequential_read(work / "store" / "packs"),
        }
        read: dict[str, list[float]] = {k: [] for k in ways}
        warm: dict[str, list[float]] = {k: [] for k in ways}
        share: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        take()
        threads = held[0].threads
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                evict(work / "store")
                scramble(dest)
                t0 = time.perf_counter()
                ways[name]()
                read[name].append(time.perf_counter() - t0)
                s = large_folio_share(packs(work / "store"))
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
            f"{args.rounds} rounds, medians ({os.cpu_count()} CPUs, threads={threads})"
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
    finally:
        while held:
            held.pop().close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
