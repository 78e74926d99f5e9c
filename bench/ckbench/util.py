"""Durability and measurement helpers: fsync, bytes on disk, peak RSS, formatting, machine info."""

from __future__ import annotations

import os
import platform
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30
BENCH_DIR = Path(__file__).resolve().parents[1]  # bench/
ROOT = BENCH_DIR.parent  # the repository


# ---------------------------------------------------------------------------------------------
# durability and sizes


def fresh_bytecode() -> None:
    """Write the bytecode of every module a bench child imports from a source tree (ckstore and
    this bench, where they run from a checkout), as an install does (pip compiles at install).
    A child that finds it stale or missing compiles the source at import, which a timed fresh
    process must not count, and under ``PYTHONDONTWRITEBYTECODE`` every child would again."""
    import compileall

    import ckstore

    for root in (Path(ckstore.__file__).resolve().parent, BENCH_DIR / "ckbench"):
        compileall.compile_dir(str(root), quiet=2)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(Path(dirpath) / f).st_size
            except FileNotFoundError:
                pass
    return total


def evict(root: Path) -> int:
    """Drop every file under ``root`` from the page cache (``posix_fadvise(DONTNEED)`` on each:
    no privileges needed; the files are fsynced, so clean pages go); the bytes covered."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            path = Path(dirpath) / f
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def storage_reads() -> int:
    """Bytes this process has caused to be read from storage devices (``/proc/self/io``
    ``read_bytes``: page-cache hits are not counted); -1 where unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def sequential_read(root: Path, block: int = 8 << 20) -> tuple[int, float]:
    """Read every file under ``root`` start to end in ``block``-byte reads, as fast as the disk
    goes (after :func:`evict`, a cold read); the bytes read and the seconds it took."""
    import time

    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for dirpath, _dirs, files in os.walk(root):
        for f in sorted(files):
            fd = os.open(Path(dirpath) / f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := os.readv(fd, [view]):
                    total += n
            finally:
                os.close(fd)
    return total, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# peak RSS (Linux /proc)


def proc_status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# formatting


def scrub_paths(text: str) -> str:
    """Shorten absolute file names in profiler output to repository-relative or library names."""
    text = re.sub(r"/[^\s:()]*/(site-packages|python3\.\d+)/", r"<\1>/", text)
    return text.replace(str(ROOT) + os.sep, "")


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.1f} ms"


def fmt_b(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / MiB:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# machine info


def _first_field(path: str, prefix: str) -> str | None:
    """The text after ':' on the first line of ``path`` starting with ``prefix``."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for mod in ("ckstore", "safetensors", "torchsnapshot", "blake3", "zstandard"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - informational only
            versions[mod] = None
    return versions


def machine_info() -> dict[str, Any]:
    import numpy

    mem_kib = _first_field("/proc/meminfo", "MemTotal:")
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _first_field("/proc/cpuinfo", "model name") or platform.processor() or "",
        "ram_bytes": int(mem_kib.split()[0]) * 1024 if mem_kib else 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "versions": _versions(),
    }
