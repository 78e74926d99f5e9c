"""Manifests: the tree of one snapshot, as canonical JSON (see docs/FORMAT.md).

A manifest maps every leaf key to an entry — a tensor record (dtype, global shape, the grid
block and the chunks that tile it, or the bytes inline when tiny) or a plain value — and keeps
per app_state name the container tree that rebuilds the state dict. It is stored as a content-
named object (id = blake3 of its canonical bytes) and recorded in the index, so the index can be
rebuilt from the store. Everything read back is validated: a malformed manifest raises
CorruptionError, never a half-built state.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Union

import blake3

from ._dtypes import DTYPES, itemsize
from ._values import decode_value
from .errors import CorruptionError

FORMAT = "ckstore/manifest"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 30
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(data: Any) -> bytes:
    """The one byte encoding of ``data``: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a tensor: its box in global coordinates and its content id."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    id: str


@dataclass(frozen=True)
class TensorEntry:
    """A tensor (or NumPy array): stored in chunks, or inline when tiny."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...] = ()
    block: tuple[int, ...] | None = None
    data: bytes | None = None
    container: str = "torch"
    device: str = "cpu"

    kind = "tensor"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def inline(self) -> bool:
        return self.data is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "tensor",
            "dtype": self.dtype,
            "shape": list(self.shape),
            "container": self.container,
            "device": self.device,
        }
        if self.data is not None:
            out["data"] = base64.b64encode(self.data).decode()
        else:
            out["block"] = list(self.block or ())
            out["chunks"] = [[list(c.offsets), list(c.sizes), c.id] for c in self.chunks]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], key: str) -> TensorEntry:
        try:
            dtype = str(d["dtype"])
            shape = _ints(d["shape"])
            if dtype not in DTYPES or any(s < 0 for s in shape):
                raise ValueError(f"dtype {dtype!r} / shape {shape}")
            container = str(d.get("container", "torch"))
            if container not in ("torch", "numpy"):
                raise ValueError(f"container {container!r}")
            device = str(d.get("device", "cpu"))
            if "data" in d:
                data = base64.b64decode(d["data"], validate=True)
                entry = cls(dtype, shape, data=data, container=container, device=device)
                if len(data) != entry.nbytes:
                    raise ValueError("inline data length")
                return entry
            chunks = tuple(ChunkRef(_ints(o), _ints(s), str(i)) for o, s, i in d["chunks"])
            entry = cls(dtype, shape, chunks, _ints(d["block"]), container=container, device=device)
        except CorruptionError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"manifest entry {key!r} is malformed: {exc}") from exc
        entry._validate_chunks(key)
        return entry

    def _validate_chunks(self, key: str) -> None:
        covered = 0
        for c in self.chunks:
            ok = (
                _HEX64.match(c.id)
                and len(c.offsets) == len(self.shape) == len(c.sizes)
                and all(0 <= o and 0 < s and o + s <= n for o, s, n in zip(c.offsets, c.sizes, self.shape))
            )
            if not ok:
                raise CorruptionError(f"manifest entry {key!r}: chunk {c} lies outside shape {self.shape}")
            covered += math.prod(c.sizes)
        if covered != math.prod(self.shape):
            raise CorruptionError(
                f"manifest entry {key!r}: chunks cover {covered} of {math.prod(self.shape)} elements"
            )


@dataclass(frozen=True)
class ValueEntry:
    """A plain value (number, string, bytes, list of those...) kept inline, JSON-encoded."""

    encoded: Any

    kind = "value"
    dtype = None
    shape = None

    @property
    def value(self) -> Any:
        return decode_value(self.encoded)

    @property
    def nbytes(self) -> int:
        return len(canonical_json(self.encoded))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "value", "value": self.encoded}


@dataclass(frozen=True)
class PerRankEntry:
    """A value that differed between the ranks of a distributed take: one entry per rank.

    ``entries[r]`` is what rank ``r`` held (a TensorEntry or a ValueEntry). A restore gives each
    rank its own entry and refuses ranks the take did not have; it never picks one rank's value
    for everyone.
    """

    entries: tuple[Union[TensorEntry, ValueEntry], ...]

    kind = "per_rank"

    @property
    def dtype(self) -> str | None:
        dtypes = {getattr(e, "dtype", None) for e in self.entries}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def shape(self) -> tuple[int, ...] | None:
        shapes = {getattr(e, "shape", None) for e in self.entries}
        return shapes.pop() if len(shapes) == 1 else None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def world_size(self) -> int:
        return len(self.entries)

    def tensors(self) -> list[TensorEntry]:
        return [e for e in self.entries if isinstance(e, TensorEntry)]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "per_rank", "ranks": [e.to_dict() for e in self.entries]}


Entry = Union[TensorEntry, ValueEntry, PerRankEntry]


def entry_from_dict(d: Any, key: str) -> Entry:
    """Parse one entry; anything malformed raises CorruptionError naming ``key``."""
    if isinstance(d, dict) and d.get("kind") == "per_rank":
        ranks = d.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise CorruptionError(f"manifest entry {key!r} has no per-rank entries")
        parts = []
        for r, sub in enumerate(ranks):
            if not isinstance(sub, dict) or sub.get("kind") == "per_rank":
                raise CorruptionError(f"manifest entry {key!r}: rank {r} entry is malformed")
            parts.append(entry_from_dict(sub, f"{key}[rank {r}]"))
        return PerRankEntry(tuple(parts))  # type: ignore[arg-type]
    if not isinstance(d, dict) or d.get("kind") not in ("tensor", "value"):
        raise CorruptionError(f"manifest entry {key!r} has no valid kind")
    if d["kind"] == "value":
        if "value" not in d:
            raise CorruptionError(f"manifest entry {key!r} has no value")
        entry = ValueEntry(d["value"])
        entry.value  # decode once to validate
        return entry
    return TensorEntry.from_dict(d, key)


def entry_digest(entry: Entry) -> str:
    """A content digest of an entry (device excluded), used to diff snapshots cheaply."""
    d = entry.to_dict()
    d.pop("device", None)
    return blake3.blake3(canonical_json(d)).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The whole app_state of one snapshot."""

    apps: dict[str, Any]
    entries: dict[str, Entry]
    snapshot: dict[str, Any] | None = None
    """The commit's own fields (run, step, created_at, metadata, name, session): they make every
    take's manifest unique, so a manifest object has one owner, and let ``reindex`` rebuild
    snapshot rows from the store alone."""

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "apps": self.apps,
            "entries": {k: e.to_dict() for k, e in self.entries.items()},
        }
        if self.snapshot is not None:
            doc["snapshot"] = self.snapshot
        return canonical_json(doc)

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptionError(f"{where}: {len(raw)} bytes exceeds the manifest limit")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptionError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptionError(f"{where} is not a ckstore manifest")
        if doc.get("version") != VERSION:
            raise CorruptionError(f"{where} has manifest version {doc.get('version')!r}; this ckstore reads {VERSION}")
        apps, entries = doc.get("apps"), doc.get("entries")
        if not isinstance(apps, dict) or not isinstance(entries, dict):
            raise CorruptionError(f"{where} lacks apps/entries")
        snapshot = doc.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, dict):
            raise CorruptionError(f"{where} has a malformed snapshot header")
        return cls(apps, {str(k): entry_from_dict(v, str(k)) for k, v in entries.items()}, snapshot)

    def tensor_entries(self) -> list[TensorEntry]:
        """Every tensor entry, per-rank ones included."""
        out: list[TensorEntry] = []
        for e in self.entries.values():
            if isinstance(e, TensorEntry):
                out.append(e)
            elif isinstance(e, PerRankEntry):
                out.extend(e.tensors())
        return out

    def chunk_ids(self) -> set[str]:
        return {c.id for e in self.tensor_entries() for c in e.chunks}

    def logical_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensor_entries())


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)
