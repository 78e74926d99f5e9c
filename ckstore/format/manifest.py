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
import gc
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Union

import blake3

from ..errors import CorruptionError
from .chunks import ChunkRef, parse_refs
from .dtypes import ITEMSIZE, itemsize
from .tiling import tiling_problem
from .tree import tree_refs
from .values import decode_value

FORMAT = "ckstore/manifest"
VERSION = 2
"""The version a writer writes: 2 adds each chunk's check (:class:`ChunkRef`)."""
READ_VERSIONS = (1, 2)
"""The versions a reader reads (a version 1 manifest has no checks)."""
MAX_MANIFEST_BYTES = 1 << 30


_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
)
"""What ``json.dumps`` with these arguments builds on every call (``encode`` keeps no state)."""


def canonical_json(data: Any) -> bytes:
    """The one byte encoding of ``data``: sorted keys, no spaces, ASCII, no NaN."""
    return _CANONICAL.encode(data).encode()


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
            out["chunks"] = [c.to_list() for c in self.chunks]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], key: str) -> TensorEntry:
        try:
            dtype = str(d["dtype"])
            shape = _ints(d["shape"])
            if dtype not in ITEMSIZE or any(s < 0 for s in shape):
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
            chunks = parse_refs(d["chunks"], len(shape))
            entry = cls(dtype, shape, chunks, _ints(d["block"]), container=container, device=device)
        except CorruptionError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"manifest entry {key!r} is malformed: {exc}") from exc
        entry._validate_chunks(key)
        return entry

    def _validate_chunks(self, key: str) -> None:
        """The chunks must tile the shape: valid ids, inside the shape, disjoint, covering it."""
        problem = tiling_problem(self.shape, self.chunks)
        if problem is not None:
            raise CorruptionError(f"manifest entry {key!r}: {problem}")


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
    rank its own entry; ranks the take did not have are refused (strict) or keep their own
    value (``strict=False``). It never picks one rank's value for everyone.
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
        _ = entry.value  # decode once to validate
        return entry
    return TensorEntry.from_dict(d, key)


def entry_digest(entry: Entry) -> str:
    """A content digest of an entry (device and chunk checks excluded: a check follows from
    its chunk id, and a version 1 manifest has none), used to diff snapshots cheaply."""
    d = _without_checks(entry.to_dict())
    d.pop("device", None)
    return blake3.blake3(canonical_json(d)).hexdigest()


def _without_checks(d: dict[str, Any]) -> dict[str, Any]:
    if "chunks" in d:
        d["chunks"] = [c[:3] for c in d["chunks"]]
    if "ranks" in d:
        d["ranks"] = [_without_checks(r) for r in d["ranks"]]
    return d


def snapshot_header(
    *,
    run: str,
    step: int | None,
    created_at: float,
    metadata: dict[str, Any],
    name: str | None,
    session: str,
    **extra: Any,
) -> dict[str, Any]:
    """The ``snapshot`` header of a take's manifest (see :attr:`Manifest.snapshot`); ``extra``
    adds the distributed fields (``world_size``, ``ranks``, ``dcp``)."""
    return {
        "run": run,
        "step": step,
        "created_at": created_at,
        "metadata": dict(metadata),
        "name": name,
        "session": session,
        **extra,
    }


@dataclass(frozen=True)
class Manifest:
    """The whole app_state of one snapshot."""

    apps: dict[str, Any]
    entries: dict[str, Entry]
    snapshot: dict[str, Any] | None = None
    """The commit's own fields (run, step, created_at, metadata, name, session): they make every
    take's manifest unique, so a manifest object has one owner, and let ``reindex`` rebuild
    snapshot rows from the store alone."""
    parts: tuple[str, ...] = ()
    """A manifest stored in parts (version 2, ``format/parts.py``): the ids of the part and node
    objects it was assembled from, chunks its snapshot references like its tensors' chunks.
    Empty for a manifest stored as one object (version 1)."""
    parted: frozenset[str] = frozenset()
    """Version 2: the keys whose chunks (or per-rank values) live in the parts; the index keeps
    ``parts.parted_digest`` for them."""

    def to_json(self) -> bytes:
        """The canonical JSON of the document ``{"apps", "entries", "format", "snapshot",
        "version"}``, written entry by entry: the same bytes as encoding the document whole,
        but each entry's dicts and lists are gone before the next is built (built all at once,
        a state of a thousand tensors left thousands of them alive for Python's collector to
        promote)."""
        enc = _CANONICAL.encode
        entries = self.entries
        out = [
            '{"apps":',
            enc(self.apps),
            ',"entries":{',
            ",".join(f"{enc(k)}:{enc(entries[k].to_dict())}" for k in sorted(entries)),
            '},"format":',
            enc(FORMAT),
        ]
        if self.snapshot is not None:
            out += [',"snapshot":', enc(self.snapshot)]
        out += [',"version":', enc(VERSION), "}"]
        return "".join(out).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptionError(f"{where}: {len(raw)} bytes exceeds the manifest limit")
        try:
            with gc_paused():
                doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, and
            # ValueError for an integer of more digits than int() converts
            raise CorruptionError(f"{where} is not valid JSON: {exc}") from exc
        return cls.from_doc(doc, where)

    @classmethod
    def from_doc(cls, doc: Any, where: str = "manifest") -> Manifest:
        """:meth:`from_json` of the JSON already decoded."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptionError(f"{where} is not a ckstore manifest")
        if doc.get("version") not in READ_VERSIONS:
            raise CorruptionError(
                f"{where} has manifest version {doc.get('version')!r}; this ckstore reads "
                f"{', '.join(map(str, READ_VERSIONS))}: upgrade ckstore to read it"
            )
        apps, entries = doc.get("apps"), doc.get("entries")
        if not isinstance(apps, dict) or not isinstance(entries, dict):
            raise CorruptionError(f"{where} lacks apps/entries")
        snapshot = doc.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, dict):
            raise CorruptionError(f"{where} has a malformed snapshot header")
        with gc_paused():
            parsed = {str(k): entry_from_dict(v, str(k)) for k, v in entries.items()}
        check_refs(apps, parsed, where)
        return cls(apps, parsed, snapshot)

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
        """The chunks of its tensors."""
        return {c.id for e in self.tensor_entries() for c in e.chunks}

    def referenced_ids(self) -> set[str]:
        """Every chunk its snapshot references: its tensors' chunks and its parts."""
        return self.chunk_ids() | set(self.parts)

    def logical_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensor_entries())


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)


def check_refs(apps: dict[str, Any], entries: Mapping[str, object], where: str) -> None:
    """Every ``{"$ref": key}`` of the app trees names an entry, once; every entry is named."""
    seen: set[str] = set()
    for name, tree in apps.items():
        try:
            refs = tree_refs(tree)
        except CorruptionError as exc:
            raise CorruptionError(f"{where}: the tree of app {name!r} is malformed: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise CorruptionError(f"{where}: the tree of app {name!r} is malformed: {why}") from exc
        for key in refs:
            if key not in entries:
                raise CorruptionError(
                    f"{where}: app {name!r} references key {key!r}, which has no entry"
                )
            if key in seen:
                raise CorruptionError(f"{where}: key {key!r} is referenced twice by the app trees")
            seen.add(key)
    if len(seen) != len(entries):
        orphans = [k for k in entries if k not in seen]
        raise CorruptionError(
            f"{where}: entry {orphans[0]!r} is referenced by no app tree ({len(orphans)} such entries)"
        )


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while parsing a manifest.

    A large manifest allocates hundreds of thousands of small lists and tuples, none in a
    cycle; the collections they trigger otherwise take longer than the parse itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
