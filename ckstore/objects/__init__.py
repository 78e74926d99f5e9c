"""The object layer: backends, hashing, codecs, packs and the verified object store.

Never imports torch or the index layer. The fsspec-based backends (``FsspecBackend``,
``memory_backend``, ``S3Backend``) are imported on first use, so a local store never loads fsspec;
so are the pack scanner (``scan_pack``, for checks) and the backend wrappers, which a restore
does not need.
"""

from typing import TYPE_CHECKING, Any

from ckstore.objects.backend import Backend, validate_name
from ckstore.objects.chunk_reader import ChunkReader
from ckstore.objects.codecs import (
    BYTEGROUP_ZSTD,
    CODECS,
    EXP_ZSTD,
    FAST_CODECS,
    NONE,
    XOR_BYTEGROUP_ZSTD,
    XOR_ZSTD,
    ZSTD,
    decode,
    encode,
    grouped_size,
    is_delta,
)
from ckstore.objects.delta import encode_delta
from ckstore.objects.hashing import CHECK_NAME, HASH_NAME, chunk_id, is_chunk_id, raw_check
from ckstore.objects.into_place import UNCHECKED
from ckstore.objects.local import LocalBackend
from ckstore.objects.location import ChunkLocation
from ckstore.objects.opener import open_backend
from ckstore.objects.packs import (
    PackIndex,
    PackWriter,
    load_pack_index,
    pack_id_from_name,
    pack_name,
    pack_overhead,
    read_pack_index,
)
from ckstore.objects.payloads import Kept
from ckstore.objects.store import ObjectStore, blob_name

if TYPE_CHECKING:
    from ckstore.objects.fsspec_backend import FsspecBackend, memory_backend
    from ckstore.objects.pack_scan import PackProblem, PackScan, scan_pack, verify_pack
    from ckstore.objects.s3 import S3Backend
    from ckstore.objects.wrappers import (
        CountingBackend,
        FaultyBackend,
        StashingBackend,
        WrappingBackend,
    )

_LAZY = {
    "FsspecBackend": "fsspec_backend",
    "memory_backend": "fsspec_backend",
    "S3Backend": "s3",
    "PackProblem": "pack_scan",
    "PackScan": "pack_scan",
    "scan_pack": "pack_scan",
    "verify_pack": "pack_scan",
    "CountingBackend": "wrappers",
    "FaultyBackend": "wrappers",
    "StashingBackend": "wrappers",
    "WrappingBackend": "wrappers",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BYTEGROUP_ZSTD",
    "CHECK_NAME",
    "CODECS",
    "EXP_ZSTD",
    "FAST_CODECS",
    "HASH_NAME",
    "NONE",
    "UNCHECKED",
    "XOR_BYTEGROUP_ZSTD",
    "XOR_ZSTD",
    "ZSTD",
    "Backend",
    "ChunkLocation",
    "ChunkReader",
    "CountingBackend",
    "FaultyBackend",
    "FsspecBackend",
    "Kept",
    "LocalBackend",
    "ObjectStore",
    "PackIndex",
    "PackProblem",
    "PackScan",
    "PackWriter",
    "S3Backend",
    "StashingBackend",
    "WrappingBackend",
    "blob_name",
    "chunk_id",
    "decode",
    "encode",
    "encode_delta",
    "grouped_size",
    "is_chunk_id",
    "is_delta",
    "load_pack_index",
    "memory_backend",
    "open_backend",
    "pack_id_from_name",
    "pack_name",
    "pack_overhead",
    "raw_check",
    "read_pack_index",
    "scan_pack",
    "validate_name",
    "verify_pack",
]
