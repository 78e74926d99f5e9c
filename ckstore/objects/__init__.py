"""The object layer: backends, hashing, codecs, packs and the verified object store.

Never imports torch or the index layer.
"""

from ckstore.objects.backend import Backend, validate_name
from ckstore.objects.codecs import BYTEGROUP_ZSTD, CODECS, NONE, ZSTD, decode, encode, grouped_size
from ckstore.objects.fsspec_backend import FsspecBackend, memory_backend
from ckstore.objects.hashing import HASH_NAME, chunk_id, is_chunk_id
from ckstore.objects.local import LocalBackend
from ckstore.objects.opener import open_backend
from ckstore.objects.pack_scan import PackProblem, PackScan, scan_pack, verify_pack
from ckstore.objects.packs import (
    ChunkLocation,
    PackIndex,
    PackWriter,
    load_pack_index,
    pack_id_from_name,
    pack_name,
    pack_overhead,
    read_pack_index,
)
from ckstore.objects.s3 import S3Backend
from ckstore.objects.store import ObjectStore, blob_name
from ckstore.objects.wrappers import CountingBackend, FaultyBackend, WrappingBackend

__all__ = [
    "BYTEGROUP_ZSTD",
    "CODECS",
    "HASH_NAME",
    "NONE",
    "ZSTD",
    "Backend",
    "ChunkLocation",
    "CountingBackend",
    "FaultyBackend",
    "FsspecBackend",
    "LocalBackend",
    "ObjectStore",
    "PackIndex",
    "PackProblem",
    "PackScan",
    "PackWriter",
    "S3Backend",
    "WrappingBackend",
    "blob_name",
    "chunk_id",
    "decode",
    "encode",
    "grouped_size",
    "is_chunk_id",
    "load_pack_index",
    "memory_backend",
    "open_backend",
    "pack_id_from_name",
    "pack_name",
    "pack_overhead",
    "read_pack_index",
    "scan_pack",
    "validate_name",
    "verify_pack",
]
