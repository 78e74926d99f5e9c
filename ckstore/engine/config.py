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
from ..format.limits import check_int

CONFIG_NAME = "ckstore.json"
FORMAT_NAME = "ckstore"
FORMAT_VERSION = 1
FEATURES: tuple[str, ...] = ("blake3-ids", "packs-v1", "bytegroup-zstd", "manifest-v1")

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_PACK_BYTES = 64 << 20
DEFAULT_INLINE_BYTES = 2048
DEFAULT_LEASE_SECONDS = 600.0
MAX_LEASE_SECONDS = 7 * 86400.0
MAX_THREADS = 1024

MIN_CHUNK_BYTES = 16
MAX_CHUNK_BYTES = 1 << 30
"""A chunk is decoded in memory whole: at most 1 GiB."""
MAX_PACK_BYTES = 1 << 36
"""A pack is written by one put: at most 64 GiB."""
MAX_INLINE_BYTES = 1 << 20
"""Inline tensors live in the manifest (at most 1 GiB): at most 1 MiB each."""


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
    def new(
        cls, chunk_bytes: int | None, pack_bytes: int | None, inline_bytes: int | None
    ) -> StoreConfig:
        """The config of a new store; None takes a knob's default.

        Raises:
            InvalidInputError: a knob is not an int or is out of range (FORMAT.md section 10).
        """
        chunk = (
            DEFAULT_CHUNK_BYTES
            if chunk_bytes is None
            else check_int("chunk_bytes", chunk_bytes, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
        )
        pack = (
            DEFAULT_PACK_BYTES
            if pack_bytes is None
            else check_int("pack_bytes", pack_bytes, MIN_CHUNK_BYTES, MAX_PACK_BYTES)
        )
        inline = (
            DEFAULT_INLINE_BYTES
            if inline_bytes is None
            else check_int("inline_bytes", inline_bytes, 0, MAX_INLINE_BYTES)
        )
        cfg = cls(
            store_id=uuid.uuid4().hex, chunk_bytes=chunk, pack_bytes=pack, inline_bytes=inline
        )
        if not cfg.knobs_valid():
            raise InvalidInputError(
                f"store knobs out of range: chunk_bytes={cfg.chunk_bytes} (16 to 2**30), "
                f"pack_bytes={cfg.pack_bytes} (chunk_bytes to 2**36), inline_bytes="
                f"{cfg.inline_bytes} (0 to 2**20)"
            )
        return cfg

    def knobs_valid(self) -> bool:
        return (
            MIN_CHUNK_BYTES <= self.chunk_bytes <= min(self.pack_bytes, MAX_CHUNK_BYTES)
            and self.pack_bytes <= MAX_PACK_BYTES
            and 0 <= self.inline_bytes <= MAX_INLINE_BYTES
        )

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
            raise SchemaError(
                f"store {where} uses features {sorted(unknown)} this ckstore lacks: upgrade ckstore"
            )
        try:
            knobs = [d[k] for k in ("chunk_bytes", "pack_bytes", "inline_bytes")]
            if not all(type(k) is int for k in knobs) or type(d["store_id"]) is not str:
                raise TypeError(
                    f"store_id, chunk_bytes, pack_bytes, inline_bytes of the wrong type: {d}"
                )
            cfg = cls(
                store_id=d["store_id"],
                chunk_bytes=knobs[0],
                pack_bytes=knobs[1],
                inline_bytes=knobs[2],
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


DEFAULT_DELTA_DEPTH = 1
"""Longest chain a take builds by default: every delta is taken against a full chunk (a
keyframe), so reading a chunk decodes at most 2 payloads and a take reads one base. Measured
on the benchmark's training run (a save every 10 steps): depth 2 stores 0.5 (fp32 + AdamW) to
3 (bf16 weights) points of raw less, and restores its deepest snapshot 1.2-1.6x slower than
depth 1 (each link costs about a full chunk's decompression); see docs/USAGE.md, "Deltas"."""
MAX_DELTA_DEPTH = 32
"""The largest depth limit accepted (readers follow chains of up to 64 links)."""


def check_delta_base(value: Any) -> str | None:
    """``value`` as a ``delta_base`` option: None, ``"parent"`` or a snapshot ref.

    Raises:
        InvalidInputError: not None and not a non-empty string.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(
            f"delta_base must be None, 'parent' or a snapshot ref (run@step, tag, name, id), got {value!r}"
        )
    return value


TAKE_CODECS = ("fast", "raw", "dense")
"""How a take encodes new whole chunks: ``fast`` (``exp-zstd`` for floats, raw otherwise; what
compaction later rewrites densely), ``raw`` (the default: no encoding at all, the fastest
takes and restores, the most bytes until compaction) or ``dense`` (``bytegroup-zstd`` / ``zstd``, as
compaction writes: smaller at once, slower on the take's critical path)."""
