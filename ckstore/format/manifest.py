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
import operator
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any, Union

import blake3

from ..errors import CorruptionError
from .dtypes import ITEMSIZE, itemsize
from .tree import tree_refs
from .values import decode_value

FORMAT = "ckstore/manifest"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 30
_HEX64 = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would let a trailing newline in
_BULK = 16  # chunk lists longer than this are type-checked in bulk


def canonical_json(data: Any) -> bytes:
    """The one byte encoding of ``data``: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


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
            chunks = _chunk_refs(d["chunks"], len(shape))
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
    """A content digest of an entry (device excluded), used to diff snapshots cheaply."""
    d = entry.to_dict()
    d.pop("device", None)
    return blake3.blake3(canonical_json(d)).hexdigest()


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
            with _gc_paused():
                doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, and
            # ValueError for an integer of more digits than int() converts
            raise CorruptionError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptionError(f"{where} is not a ckstore manifest")
        if doc.get("version") != VERSION:
            raise CorruptionError(
                f"{where} has manifest version {doc.get('version')!r}; this ckstore reads {VERSION}"
            )
        apps, entries = doc.get("apps"), doc.get("entries")
        if not isinstance(apps, dict) or not isinstance(entries, dict):
            raise CorruptionError(f"{where} lacks apps/entries")
        snapshot = doc.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, dict):
            raise CorruptionError(f"{where} has a malformed snapshot header")
        with _gc_paused():
            parsed = {str(k): entry_from_dict(v, str(k)) for k, v in entries.items()}
        _check_refs(apps, parsed, where)
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
        return {c.id for e in self.tensor_entries() for c in e.chunks}

    def logical_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensor_entries())


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)


def _chunk_refs(raw: Any, ndim: int) -> tuple[ChunkRef, ...]:
    """Parse ``[[offsets], [sizes], id]`` triples; each list must hold exactly ``ndim`` ints.

    The types are checked in bulk (C loops over the whole list), which keeps a manifest with
    thousands of chunks fast to parse; on failure, the first bad triple is named.
    """
    if type(raw) is not list:
        raise ValueError("chunks is not a list")
    if len(raw) > _BULK and set(map(type, raw)) == {list} and set(map(len, raw)) == {3}:
        offs, sizes, ids = zip(*raw)
        if (
            {*map(type, offs), *map(type, sizes)} == {list}
            and {*map(len, offs), *map(len, sizes)} == {ndim}
            and set(map(type, chain.from_iterable((*offs, *sizes)))) <= {int}
            and set(map(type, ids)) == {str}
        ):
            return tuple(map(ChunkRef, map(tuple, offs), map(tuple, sizes), ids))
    ints = (int,) * ndim  # type() is exact: bools and floats are refused
    out = []
    for item in raw:
        if type(item) is not list or len(item) != 3:
            raise ValueError(f"chunk {str(item)[:80]} is not [offsets, sizes, id]")
        o, s, cid = item
        lists = type(o) is type(s) is list
        if not (lists and tuple(map(type, o)) == tuple(map(type, s)) == ints and type(cid) is str):
            raise ValueError(f"chunk {str(item)[:80]} is not [offsets, sizes, id] of {ndim} ints")
        out.append(ChunkRef(tuple(o), tuple(s), cid))
    return tuple(out)


def _hex_ids(ids: list[str]) -> bool:
    """True if every id is 64 lowercase hex digits (one pass over all of them at once)."""
    if set(map(len, ids)) - {64}:
        return False
    joined = "".join(ids)
    try:
        # fromhex skips whitespace: an equal digit count rules it out
        digits = 2 * len(bytes.fromhex(joined))
        return joined.isascii() and joined == joined.lower() and digits == len(joined)
    except ValueError:
        return False


def tiling_problem(shape: tuple[int, ...], chunks: Sequence[ChunkRef]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly once, or None when they do.

    Checked: ids are 64 lowercase hex digits; every box has the tensor's rank and lies inside
    it with positive sizes; the boxes hold as many elements as the tensor; no two boxes overlap.
    Equal element counts plus no overlap means the boxes cover every element exactly once.
    The whole check is O(n log n) in the number of chunks for the tilings ckstore writes
    (see :func:`_overlapping_pair`).
    """
    n, ndim = len(chunks), len(shape)
    if n == 1 and _HEX64.fullmatch(chunks[0].id):  # the common case: one chunk, the whole tensor
        c = chunks[0]
        if c.offsets == (0,) * ndim and c.sizes == shape and 0 not in shape:
            return None
    if not _hex_ids([c.id for c in chunks]):
        bad = next(c.id for c in chunks if not (type(c.id) is str and _HEX64.fullmatch(c.id)))
        return f"chunk id {str(bad)[:80]!r} is not 64 lowercase hex digits"
    offs = [c.offsets for c in chunks]
    sizes = [c.sizes for c in chunks]
    if {*map(len, offs), *map(len, sizes)} - {ndim}:
        c = next(c for c in chunks if len(c.offsets) != ndim or len(c.sizes) != ndim)
        return f"chunk {_box(c)} does not have the {ndim} dimensions of shape {list(shape)}"
    ocols: list[tuple[int, ...]] = list(zip(*offs)) if n and ndim else [()] * ndim
    scols: list[tuple[int, ...]] = list(zip(*sizes)) if n and ndim else [()] * ndim
    ecols: list[list[int]] = []
    for d, extent in enumerate(shape):
        e_d = list(map(operator.add, ocols[d], scols[d]))
        if n and (min(ocols[d]) < 0 or min(scols[d]) <= 0 or max(e_d) > extent):
            c = next(
                c for c in chunks if not 0 <= c.offsets[d] < c.offsets[d] + c.sizes[d] <= extent
            )
            return f"chunk {_box(c)} lies outside shape {list(shape)}"
        ecols.append(e_d)
    volumes = [1] * n
    for s_d in scols:
        volumes = list(map(operator.mul, volumes, s_d))
    covered, total = sum(volumes), math.prod(shape)
    if covered != total:
        return f"chunks cover {covered} of {total} elements"
    pair = _overlapping_pair(offs, ocols, ecols)
    if pair is not None:
        return f"chunks {_box(chunks[pair[0]])} and {_box(chunks[pair[1]])} overlap"
    return None


def _overlapping_pair(
    offs: list[tuple[int, ...]], ocols: list[tuple[int, ...]], ecols: list[list[int]]
) -> tuple[int, int] | None:
    """Indices of two overlapping boxes (given per box and per dimension), or None.

    Fast path: the boxes ckstore writes are grid blocks cut by shard boxes. Both are product
    partitions of the tensor, so every box is one cell of the partition whose cut points, per
    dimension, are all box starts and ends: each box spans exactly one gap between consecutive
    cut points in every dimension. Boxes that are single cells overlap only if they are the same
    cell, i.e. start at the same offsets. Other tilings fall back to a sweep along the dimension
    with the most distinct starts, comparing each box with the boxes still open there.
    """
    if len(offs) < 2:
        return None
    first: dict[tuple[int, ...], int] = {}
    for i, o in enumerate(offs):
        j = first.setdefault(o, i)
        if j != i:
            return j, i
    if all(_single_cells(o_d, e_d) for o_d, e_d in zip(ocols, ecols)):
        return None
    return _sweep(ocols, ecols)


def _single_cells(starts: tuple[int, ...], ends: list[int]) -> bool:
    """True if each interval [start, end) runs from one cut point to the next one."""
    points = sorted({*starts, *ends})
    following = dict(pairwise(points))
    return list(map(following.__getitem__, starts)) == ends


def _sweep(ocols: list[tuple[int, ...]], ecols: list[list[int]]) -> tuple[int, int] | None:
    ndim = len(ocols)
    d = max(range(ndim), key=lambda k: len(set(ocols[k])))
    starts, ends = ocols[d], ecols[d]
    active: list[int] = []
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        active = [j for j in active if ends[j] > starts[i]]
        for j in active:
            if all(ocols[k][i] < ecols[k][j] and ocols[k][j] < ecols[k][i] for k in range(ndim)):
                return j, i
        active.append(i)
    return None


def _box(c: ChunkRef) -> str:
    return f"{list(c.offsets)}+{list(c.sizes)}"


def _check_refs(apps: dict[str, Any], entries: dict[str, Entry], where: str) -> None:
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
def _gc_paused() -> Iterator[None]:
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
