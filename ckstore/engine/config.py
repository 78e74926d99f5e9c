"""The store's own config object (``ckstore.json``): format version, feature flags, knobs.

Written once, create-if-absent, when a store is made; read and checked on every open. Knobs
that change the bytes written (chunk size, inline limit) live here so every writer of one
store cuts tensors on the same grid and dedups against the others.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CorruptionError, InvalidInputError, SchemaError

CONFIG_NAME = "ckstore.json"
FORMAT_NAME = "ckstore"
FORMAT_VERSION = 1
FEATURES: tuple[str, ...] = ("blake3-ids", "packs-v1", "bytegroup-zstd", "manifest-v1")

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_PACK_BYTES = 64 << 20
DEFAULT_INLINE_BYTES = 2048
DEFAULT_LEASE_SECONDS = 600.0


@dataclass(frozen=True)
class StoreConfig:
    """What every writer of a store must agree on."""

    store_id: str
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pack_bytes: int = DEFAULT_PACK_BYTES
    inline_bytes: int = DEFAULT_INLINE_BYTES
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    hash: str = "blake3"
    features: tuple[str, ...] = field(default=FEATURES)

    @classmethod
    def new(cls, chunk_bytes: int | None, pack_bytes: int | None, inline_bytes: int | None) -> StoreConfig:
        cfg = cls(
            store_id=uuid.uuid4().hex,
            chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES,
            pack_bytes=pack_bytes or DEFAULT_PACK_BYTES,
            inline_bytes=DEFAULT_INLINE_BYTES if inline_bytes is None else inline_bytes,
        )
        if not cfg.knobs_valid():
            raise InvalidInputError(
                f"store knobs out of range: chunk_bytes={cfg.chunk_bytes} (>= 16), "
                f"pack_bytes={cfg.pack_bytes} (>= chunk_bytes), inline_bytes={cfg.inline_bytes} (>= 0)"
            )
        return cfg

    def knobs_valid(self) -> bool:
        return 16 <= self.chunk_bytes <= self.pack_bytes and self.inline_bytes >= 0

    def to_json(self) -> bytes:
        d = asdict(self)
        d["features"] = list(self.features)
        return json.dumps(d, sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> StoreConfig:
        try:
            d: dict[str, Any] = json.loads(raw)
        except ValueError as exc:
            raise CorruptionError(f"{where}/{CONFIG_NAME} is not valid JSON") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CorruptionError(f"{where}/{CONFIG_NAME} is not a ckstore config")
        if d.get("format_version") != FORMAT_VERSION or d.get("hash") != "blake3":
            raise SchemaError(
                f"store {where} has format version {d.get('format_version')} (hash "
                f"{d.get('hash')}); this ckstore reads version {FORMAT_VERSION}: upgrade ckstore"
            )
        unknown = set(d.get("features", ())) - set(FEATURES)
        if unknown:
            raise SchemaError(f"store {where} uses features {sorted(unknown)} this ckstore lacks: upgrade ckstore")
        try:
            cfg = cls(
                store_id=str(d["store_id"]),
                chunk_bytes=int(d["chunk_bytes"]),
                pack_bytes=int(d["pack_bytes"]),
                inline_bytes=int(d["inline_bytes"]),
                features=tuple(d.get("features", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"{where}/{CONFIG_NAME} lacks {exc}") from exc
        if not cfg.knobs_valid():
            raise CorruptionError(f"{where}/{CONFIG_NAME} holds out-of-range knobs: {d}")
        return cfg


RESTORE_BUDGET_FRACTION = 0.03
"""By default an atomic restore stages at most this fraction of the bytes it restores (with the
per-thread read buffers, peak memory stays within ~10% above the live state at every size)."""

RESTORE_BUDGET_CAP = 512 << 20
"""...and never more than this many bytes (nor 5% of physical memory)."""


def default_memory_budget() -> int | None:
    """``$CKSTORE_MEMORY_BUDGET`` (bytes) if set, else None: :func:`restore_budget` decides
    per restore from the size of what it restores."""
    env = os.environ.get("CKSTORE_MEMORY_BUDGET")
    return max(0, int(env)) if env else None


def restore_budget(budget: int | None, restored_bytes: int) -> int:
    """Staging memory a restore of ``restored_bytes`` may use: ``budget`` when given, else
    ``RESTORE_BUDGET_FRACTION`` of ``restored_bytes``, at most ``RESTORE_BUDGET_CAP`` and 5% of
    physical memory."""
    if budget is not None:
        return max(0, budget)
    return min(budget_cap(), int(restored_bytes * RESTORE_BUDGET_FRACTION))


def budget_cap() -> int:
    """The most staging memory a restore uses by default: ``RESTORE_BUDGET_CAP`` or 5% of
    physical memory, whichever is smaller."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return min(RESTORE_BUDGET_CAP, physical // 20)


def default_staging_budget() -> int:
    """Copy memory an async take may use: ``$CKSTORE_STAGING_BUDGET`` (bytes) or half of the
    RAM available now (``MemAvailable``, which counts page cache the kernel can drop: free
    memory alone shrinks to almost nothing once checkpoints have filled the cache)."""
    env = os.environ.get("CKSTORE_STAGING_BUDGET")
    if env:
        return max(0, int(env))
    available = _mem_available()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 8 << 30
    return available // 2


def _mem_available() -> int | None:
    """Linux's estimate of memory available without swapping, or None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_threads() -> int:
    """Worker threads for hashing/compression/IO: ``$CKSTORE_THREADS`` or the CPU count."""
    env = os.environ.get("CKSTORE_THREADS")
    if env:
        return max(1, int(env))
    return max(2, os.cpu_count() or 2)


def default_io_threads() -> int:
    """Packs a take writes at once: ``$CKSTORE_IO_THREADS`` or 4. Several writes in flight keep
    a disk busy through each pack's fsync (and S3 through each upload's latency); each holds
    up to one pack of encoded bytes in memory."""
    env = os.environ.get("CKSTORE_IO_THREADS")
    if env:
        return max(1, int(env))
    return 4
