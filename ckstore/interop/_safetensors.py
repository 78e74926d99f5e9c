"""The safetensors file format, read memory-mapped and written as a stream.

A file is an 8-byte little-endian header length N, N bytes of JSON (``name -> {"dtype",
"shape", "data_offsets": [begin, end]}`` plus an optional ``"__metadata__"`` of str -> str),
then the data; offsets are relative to the end of the header. Reading validates the header at
the trust boundary (size limit, offsets inside the file, lengths matching dtype and shape, no
overlaps) and maps the file instead of reading it, so a file of any size imports in bounded
memory. Writing lays out the header first, then streams each tensor's bytes as they are read
from the store, so export never holds a whole shard either.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import blake3
import torch

from ..errors import CorruptionError, InvalidInputError, UnsupportedValueError
from ..format.digests import METADATA_KEY, ZERO, metadata_value, self_digest
from ..format.dtypes import DTYPES

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted (safetensors' own limit)."""
_ALIGN = 8

# safetensors dtype code <-> ckstore dtype name
CODES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
CODES = {c: n for c, n in CODES.items() if n in DTYPES}
NAMES = {n: c for c, n in CODES.items()}


@dataclass(frozen=True)
class Item:
    """One tensor of a safetensors file: dtype name, shape, byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    items: dict[str, Item]
    metadata: dict[str, str]
    data_start: int


def read_header(path: str) -> Header:
    """Parse and validate the header of ``path``.

    Raises:
        InvalidInputError: the file is not a valid safetensors file (says what is wrong).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidInputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidInputError(
                f"{path}: not a safetensors file (header length {n} for a {size}-byte file)"
            )
        raw = f.read(n)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"{path}: safetensors header is not JSON ({exc})") from None
    except RecursionError:
        raise InvalidInputError(
            f"{path}: safetensors header is nested too deeply to be read (a tensor entry is "
            "one level deep): not a safetensors file"
        ) from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{path}: safetensors header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidInputError(f"{path}: safetensors __metadata__ must map str to str")
    items = {name: _item(path, name, d) for name, d in doc.items()}
    _check_layout(path, items, size - 8 - n)
    return Header(items, {str(k): v for k, v in meta.items()}, 8 + n)


def _item(path: str, name: str, d: Any) -> Item:
    try:
        code, shape, (begin, end) = d["dtype"], tuple(d["shape"]), d["data_offsets"]
        if (
            not all(type(s) is int and s >= 0 for s in shape)
            or type(begin) is not int
            or type(end) is not int
        ):
            raise TypeError("shape and offsets must be non-negative ints")
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"{path}: safetensors entry {name!r} is malformed ({exc})"
        ) from None
    if code not in CODES:
        raise UnsupportedValueError(
            f"{path}: tensor {name!r} has dtype {code!r}, which ckstore does not store"
        )
    dtype = CODES[code]
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
        raise InvalidInputError(
            f"{path}: tensor {name!r}: {end - begin} bytes do not hold {code} {list(shape)}"
        )
    return Item(name, dtype, shape, begin, end)


def _check_layout(path: str, items: dict[str, Item], data_bytes: int) -> None:
    pos = 0
    for it in sorted(items.values(), key=lambda i: (i.begin, i.end)):
        if it.begin < pos or it.end > data_bytes:
            raise InvalidInputError(
                f"{path}: tensor {it.name!r} overlaps another or lies past the end of the file"
            )
        pos = it.end


def map_tensors(path: str, header: Header) -> dict[str, torch.Tensor]:
    """Every tensor of the file as a view of one read-only private mapping (nothing is read yet)."""
    size = os.path.getsize(path)
    raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    out = {}
    for name, it in header.items.items():
        dtype = DTYPES[it.dtype]
        start = header.data_start + it.begin
        piece = raw[start : header.data_start + it.end]
        if it.end == it.begin:
            out[name] = torch.empty(it.shape, dtype=dtype)
        elif start % dtype.itemsize == 0:
            out[name] = piece.view(dtype).reshape(it.shape)
        else:  # unaligned: copy (rare; safetensors writers align)
            out[name] = piece.clone().view(dtype).reshape(it.shape)
    return out


@dataclass(frozen=True)
class Planned:
    """One tensor to write: its name in the file, stored dtype and shape, and the key it comes from."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def header_bytes(items: list[Planned], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus the JSON header for ``items`` written in order, padded to 8 bytes."""
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for it in items:
        doc[it.name] = {
            "dtype": NAMES[it.dtype],
            "shape": list(it.shape),
            "data_offsets": [pos, pos + it.nbytes],
        }
        pos += it.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def check_dtype(dtype: str, key: str) -> None:
    """Refuse a dtype safetensors cannot hold, naming the key."""
    if dtype not in NAMES:
        raise UnsupportedValueError(
            f"key {key!r} is {dtype}, which safetensors cannot hold; export it with --format torch, "
            "or leave it out with --keys"
        )


def write_stream(
    f: BinaryIO,
    items: list[Planned],
    metadata: dict[str, str],
    chunks: Iterator[tuple[str, memoryview]],
) -> None:
    """Write a whole file: the header, then each item's bytes in order from ``chunks``, and
    the file's own digests (docs/FORMAT.md, section 11).

    ``chunks`` yields ``(key, bytes)`` pieces in item order; their lengths must add up to each
    item's size (checked: a short or long tensor would corrupt every offset after it). Each
    tensor's BLAKE3 is taken from the same pieces as they are written; the header goes out
    first with zero digests of the same length and is written again over itself at the end
    (``f`` must be seekable).
    """
    blank = metadata_value({it.name: ZERO for it in items})
    first = header_bytes(items, {**metadata, METADATA_KEY: blank})
    f.write(first)
    want = {it.key: it.nbytes for it in items}
    got: dict[str, int] = dict.fromkeys(want, 0)
    hashers = {it.key: blake3.blake3() for it in items}
    for key, data in chunks:
        f.write(data)
        hashers[key].update(data)
        got[key] += len(data)
    bad = [k for k in want if got[k] != want[k]]
    if bad:
        raise CorruptionError(
            f"safetensors export: tensors {bad[:3]} came out with the wrong byte count"
        )
    sealed = header_bytes(
        items,
        {
            **metadata,
            METADATA_KEY: metadata_value({it.name: hashers[it.key].hexdigest() for it in items}),
        },
    )
    claimed = self_digest(sealed, ZERO)
    sealed = sealed.replace(ZERO.encode(), claimed.encode(), 1)
    if len(sealed) != len(first):  # pragma: no cover - hex digests have one length
        raise CorruptionError("safetensors export: the sealed header changed length")
    f.seek(0)
    f.write(sealed)
    f.seek(0, 2)
