"""Manifests in parts (format version 2): a root, the parts each rank wrote, nodes between them.

A distributed take's manifest lists every piece every rank wrote: stored as one object, it
grows with the world, and the rank that commits would have to receive and read all of it. In
version 2 (docs/FORMAT.md, section 7.7) it is a tree, as git's trees of trees:

* the **root** (:class:`Root`): a manifest object as in version 1 (its id is the snapshot id)
  holding the apps, the header, every entry one process knows whole (values, inline and
  replicated tensors, per-rank values equal on every rank) and, for the others, a *shell*
  (:class:`Shell`: a tensor's dtype, shape, block and layout, without chunks; or a per-rank
  entry without its values), the layouts, and the top :class:`Level` of the tree of parts;
* **part** ``r`` (:class:`Part`, a chunk, content-addressed): the pieces rank ``r`` wrote of
  every sharded tensor and rank ``r``'s own value of every per-rank entry, with its figures;
* **nodes** (a chunk each, :class:`Level`), when there are more than ``FANOUT`` parts: each
  names up to ``FANOUT`` parts (or nodes), by id and size, so no object grows with the world.

The rank that commits receives the parts' ids and sizes, never their entries; a restoring rank
reads the root, the nodes above the parts it needs and those parts (``layout.Layout`` says
which). :func:`assemble` builds the whole :class:`~ckstore.format.manifest.Manifest` from the
root and every part (validated as a version 1 manifest is); :func:`partial` one rank's view.
This module only parses and builds bytes; reading them is the engine's (``engine/manifests.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import blake3

from ..errors import CorruptionError
from .chunks import parse_refs
from .dtypes import ITEMSIZE
from .layout import Layout
from .manifest import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    ChunkRef,
    Entry,
    Manifest,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    canonical_json,
    check_refs,
    entry_from_dict,
    gc_paused,
)
from .tiling import hex_ids, tiling_problem

VERSION = 2
PART_FORMAT = "ckstore/manifest-part"
NODE_FORMAT = "ckstore/manifest-node"
FANOUT = 256
"""Children per node a writer puts in the tree (a reader follows any)."""
DIGEST_PREFIX = "parts:"
"""Index digests of the entries that live in parts (:func:`parted_digest`) start with it."""

Child = tuple[str, int]  # (id, raw bytes)
Own = Union[TensorEntry, ValueEntry]
_LANE = 1 << 32


@dataclass(frozen=True)
class Level:
    """One level of the tree of parts: parts ``first`` to ``first + count - 1``, each child
    naming ``span`` of them (a part when ``span`` is 1, else a node)."""

    first: int
    count: int
    span: int
    children: tuple[Child, ...]

    def child_of(self, part: int) -> int:
        """The index of the child whose parts include ``part``."""
        return (part - self.first) // self.span

    def child_parts(self, j: int) -> tuple[int, int]:
        """The first part under child ``j`` and how many there are."""
        first = self.first + j * self.span
        return first, min(self.span, self.first + self.count - first)

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "span": self.span,
            "children": [[cid, n] for cid, n in self.children],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str, first: int, count: int | None = None) -> Level:
        """Parse and check a level expected to cover parts from ``first`` (``count`` of them,
        when the level above says so)."""
        try:
            n, span, raw = d["count"], d["span"], d["children"]
            children = tuple((str(c[0]), c[1]) for c in raw if len(c) == 2)
        except (KeyError, TypeError, IndexError) as exc:
            raise CorruptionError(f"{where}: malformed list of parts: {exc}") from exc
        ok = (
            type(n) is int
            and type(span) is int
            and n >= 1
            and span >= 1
            and (count is None or n == count)
            and len(children) == len(raw) == -(-n // span)
            and all(type(size) is int and 0 < size <= MAX_MANIFEST_BYTES for _, size in children)
            and hex_ids([cid for cid, _ in children])
        )
        if not ok:
            raise CorruptionError(f"{where}: malformed list of parts {str(d)[:120]}")
        return cls(first, n, span, children)


def parse_node(raw: bytes, where: str, first: int, count: int, above: int) -> Level:
    """A node's level, which its parent says covers ``count`` parts from ``first`` with
    children of ``above`` parts each (a node's own children are smaller)."""
    d = _document(raw, where, NODE_FORMAT)
    if d.get("first") != first:
        raise CorruptionError(f"{where}: node covers parts from {d.get('first')!r}, not {first}")
    level = Level.from_dict(d, where, first, count)
    if level.span >= above:
        raise CorruptionError(f"{where}: a node's children span {level.span} parts each")
    return level


def build_tree(parts: Sequence[Child], fanout: int = FANOUT) -> tuple[Level, list[bytes]]:
    """The root's level over ``parts`` (part ``r`` at index ``r``) and the nodes' bytes, bottom
    level first: no level has more than ``fanout`` children."""
    if fanout < 2:
        raise ValueError(f"a tree of parts needs a fanout of at least 2, got {fanout}")
    level, span, nodes, total = list(parts), 1, [], len(parts)
    while len(level) > fanout:
        above = []
        for j in range(0, len(level), fanout):
            first = j * span
            doc = {
                "format": NODE_FORMAT,
                "version": VERSION,
                "first": first,
                **Level(
                    first, min(total - first, fanout * span), span, tuple(level[j : j + fanout])
                ).to_dict(),
            }
            raw = canonical_json(doc)
            nodes.append(raw)
            above.append((blake3.blake3(raw).hexdigest(), len(raw)))
        level, span = above, span * fanout
    return Level(0, total, span, tuple(level)), nodes


@dataclass(frozen=True)
class Shell:
    """A root entry whose chunks (``tensor``: its dtype, shape, block, without chunks) or
    per-rank values (``tensor`` None) live in the parts; ``layout`` indexes the root's layouts
    (a sharded tensor whose pieces readers locate), None where any part may hold pieces."""

    tensor: TensorEntry | None
    layout: int | None = None

    @property
    def kind(self) -> str:
        return "tensor" if self.tensor is not None else "per_rank"

    def to_dict(self) -> dict[str, Any]:
        where = {} if self.layout is None else {"layout": self.layout}
        if self.tensor is None:
            return {"kind": "per_rank", "parts": where}
        d = self.tensor.to_dict()
        del d["chunks"]
        return {**d, "parts": where}

    @classmethod
    def from_dict(cls, d: dict[str, Any], key: str, layouts: int) -> Shell:
        where = d.get("parts")
        layout = where.get("layout") if isinstance(where, dict) else None
        if not isinstance(where, dict) or not (
            layout is None or (type(layout) is int and 0 <= layout < layouts)
        ):
            raise CorruptionError(f"manifest entry {key!r}: malformed parts {str(where)[:80]}")
        if d.get("kind") == "per_rank" and layout is None:
            return cls(None)
        if d.get("kind") != "tensor":
            raise CorruptionError(f"manifest entry {key!r} in parts has no valid kind")
        try:
            dtype, shape, block = str(d["dtype"]), _ints(d["shape"]), _ints(d["block"])
            container, device = str(d.get("container", "torch")), str(d.get("device", "cpu"))
            ok = (
                dtype in ITEMSIZE
                and all(s >= 0 for s in shape)
                and len(block) == len(shape)
                and all(b >= 1 for b in block)
                and container in ("torch", "numpy")
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"manifest entry {key!r} is malformed: {exc}") from exc
        if not ok:
            raise CorruptionError(f"manifest entry {key!r} is malformed: {str(d)[:120]}")
        return cls(TensorEntry(dtype, shape, (), block, container=container, device=device), layout)


@dataclass(frozen=True)
class Root:
    """The root of a manifest in parts (see the module docstring)."""

    apps: dict[str, Any]
    entries: dict[str, Entry]
    shells: dict[str, Shell]
    layouts: tuple[Layout, ...]
    parts: Level
    snapshot: dict[str, Any] | None = None

    @property
    def world(self) -> int:
        """How many parts (ranks) there are."""
        return self.parts.count

    def to_json(self) -> bytes:
        entries = {k: e.to_dict() for k, e in self.entries.items()}
        entries.update((k, s.to_dict()) for k, s in self.shells.items())
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "apps": self.apps,
            "entries": entries,
            "layouts": [x.to_dict() for x in self.layouts],
            "parts": self.parts.to_dict(),
        }
        if self.snapshot is not None:
            doc["snapshot"] = self.snapshot
        return canonical_json(doc)

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Root:
        return cls.from_doc(_document(raw, where, FORMAT), where)

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> Root:
        apps, raw_entries, layouts = doc.get("apps"), doc.get("entries"), doc.get("layouts")
        snapshot = doc.get("snapshot")
        if not isinstance(apps, dict) or not isinstance(raw_entries, dict):
            raise CorruptionError(f"{where} lacks apps/entries")
        if not isinstance(layouts, list) or (
            snapshot is not None and not isinstance(snapshot, dict)
        ):
            raise CorruptionError(f"{where} has malformed layouts or snapshot header")
        parsed = tuple(Layout.from_dict(x, f"{where}, layout {i}") for i, x in enumerate(layouts))
        parts = Level.from_dict(doc.get("parts"), where, 0)
        world = (snapshot or {}).get("world_size", parts.count)
        if world != parts.count:
            raise CorruptionError(f"{where}: {parts.count} parts for world_size {world!r}")
        entries: dict[str, Entry] = {}
        shells: dict[str, Shell] = {}
        for k, v in raw_entries.items():
            if isinstance(v, dict) and "parts" in v:
                shells[str(k)] = Shell.from_dict(v, str(k), len(parsed))
            else:
                entries[str(k)] = entry_from_dict(v, str(k))
        check_refs(apps, {**entries, **shells}, where)
        return cls(apps, entries, shells, parsed, parts, snapshot)


@dataclass(frozen=True)
class Part:
    """What rank ``rank`` recorded: its pieces of the sharded tensors, its own value of every
    per-rank entry in parts, and its write figures (``new_bytes``, ...)."""

    rank: int
    pieces: dict[str, tuple[ChunkRef, ...]]
    own: dict[str, Own]
    figures: dict[str, int]

    def to_json(self) -> bytes:
        return canonical_json(
            {
                "format": PART_FORMAT,
                "version": VERSION,
                "rank": self.rank,
                "figures": self.figures,
                "pieces": {
                    k: [[list(c.offsets), list(c.sizes), c.id] for c in refs]
                    for k, refs in self.pieces.items()
                },
                "own": {k: e.to_dict() for k, e in self.own.items()},
            }
        )

    @classmethod
    def from_json(cls, raw: bytes, where: str, rank: int, root: Root) -> Part:
        """Parse part ``rank`` of ``root`` and check it against the root's shells."""
        d = _document(raw, where, PART_FORMAT)
        pieces, own, figures = d.get("pieces"), d.get("own"), d.get("figures")
        if d.get("rank") != rank:
            raise CorruptionError(f"{where} is the part of rank {d.get('rank')!r}, not {rank}")
        if not (isinstance(pieces, dict) and isinstance(own, dict) and isinstance(figures, dict)):
            raise CorruptionError(f"{where} lacks pieces/own/figures")
        if not all(type(v) is int and v >= 0 for v in figures.values()):
            raise CorruptionError(f"{where} has malformed figures")
        per_rank = {k for k, s in root.shells.items() if s.tensor is None}
        if set(own) != per_rank:
            odd = sorted(set(own) ^ per_rank)[:3]
            raise CorruptionError(f"{where}: its per-rank values do not match the root's ({odd})")
        refs: dict[str, tuple[ChunkRef, ...]] = {}
        for key, raw_refs in pieces.items():
            shell = root.shells.get(key)
            if shell is None or shell.tensor is None:
                raise CorruptionError(f"{where} holds pieces of {key!r}, no sharded tensor")
            try:
                refs[key] = parse_refs(raw_refs, len(shell.tensor.shape))
            except (TypeError, ValueError) as exc:
                raise CorruptionError(f"{where}: pieces of {key!r} are malformed: {exc}") from exc
        mine: dict[str, Own] = {}
        for key, e in own.items():
            if not isinstance(e, dict) or e.get("kind") == "per_rank":
                raise CorruptionError(f"{where}: its value of {key!r} is malformed")
            mine[key] = entry_from_dict(e, f"{key}[rank {rank}]")  # type: ignore[assignment]
        return cls(rank, refs, mine, dict(figures))


def assemble(root: Root, parts: Sequence[Part], ids: Sequence[str], where: str) -> Manifest:
    """The whole manifest of ``root`` from every one of its parts (``parts[r]`` is part ``r``;
    ``ids``: the part and node ids read), validated as a version 1 manifest is: every sharded
    tensor's pieces, from all parts, must tile it."""
    entries: dict[str, Entry] = {**root.entries}
    for key, shell in root.shells.items():
        if shell.tensor is None:
            entries[key] = PerRankEntry(tuple(p.own[key] for p in parts))
            continue
        refs = _merged(key, parts)
        problem = tiling_problem(shell.tensor.shape, refs)
        if problem is not None:
            raise CorruptionError(f"{where}: manifest entry {key!r}: {problem}")
        entries[key] = _with_chunks(shell.tensor, refs)
    header = dict(root.snapshot or {})
    if all(p.figures for p in parts):
        header["ranks"] = [dict(p.figures) for p in parts]
    ordered = {k: entries[k] for k in sorted(entries)}
    return Manifest(root.apps, ordered, header, tuple(ids), frozenset(root.shells))


def partial(root: Root, parts: Mapping[int, Part], rank: int, ids: Sequence[str]) -> Manifest:
    """Rank ``rank``'s view of ``root``: each sharded tensor with the pieces of ``parts`` only
    (which need not tile it: a restoring rank checks that they cover its region,
    :func:`~ckstore.format.tiling.uncovered`), each per-rank entry resolved to this rank's own
    value (a per-rank entry of fewer ranks than ``rank`` stays one, its values unread)."""
    entries: dict[str, Entry] = {**root.entries}
    chosen = sorted(parts.values(), key=lambda p: p.rank)
    for key, shell in root.shells.items():
        if shell.tensor is not None:
            entries[key] = _with_chunks(shell.tensor, _merged(key, chosen))
        elif rank < root.world:
            entries[key] = parts[rank].own[key]
        else:
            entries[key] = PerRankEntry((ValueEntry(None),) * root.world)
    ordered = {k: entries[k] for k in sorted(entries)}
    return Manifest(root.apps, ordered, root.snapshot, tuple(ids), frozenset(root.shells))


def parse_any(raw: bytes, where: str) -> Manifest | Root:
    """A manifest object: a manifest stored whole (version 1, or 2 with its chunks' checks)
    parsed whole, or the root of one stored in parts (version 2, with ``parts``)."""
    with gc_paused():
        doc = _document(raw, where, FORMAT, versions=(1, VERSION))
        if doc.get("version") == VERSION and "parts" in doc:
            return Root.from_doc(doc, where)
        return Manifest.from_doc(doc, where)


# -- index digests ------------------------------------------------------------------------------
def piece_lanes(refs: Iterable[ChunkRef]) -> list[int]:
    """The sum, in four 32-bit lanes, of a hash of each piece: what a rank adds to a sharded
    tensor's digest (sums over ranks commute: one all-reduce)."""
    return _lanes(canonical_json([list(c.offsets), list(c.sizes), c.id]) for c in refs)


def own_lanes(rank: int, entry: Own) -> list[int]:
    """A rank's share of a per-rank entry's digest: a hash of its own value, as lanes."""
    d = entry.to_dict()
    d.pop("device", None)
    return _lanes([canonical_json([rank, d])])


def shell_digest(shell: Shell, lanes: Sequence[int]) -> str:
    """The index digest of an entry in parts: its shell (device left out) and the lanes summed
    over every rank (:func:`piece_lanes`, :func:`own_lanes`)."""
    d = shell.to_dict()
    d.pop("device", None)
    d.pop("parts", None)
    total = [x % _LANE for x in lanes]
    return DIGEST_PREFIX + blake3.blake3(canonical_json([d, total])).hexdigest()


def parted_digest(entry: Entry) -> str:
    """The index digest of an assembled entry that lived in parts (as a take computes it)."""
    if isinstance(entry, PerRankEntry):
        lanes = [0] * 4
        for r, e in enumerate(entry.entries):
            lanes = [a + b for a, b in zip(lanes, own_lanes(r, e))]
        return shell_digest(Shell(None), lanes)
    assert isinstance(entry, TensorEntry)
    return shell_digest(Shell(_with_chunks(entry, ())), piece_lanes(entry.chunks))


def _lanes(items: Iterable[bytes]) -> list[int]:
    out = [0, 0, 0, 0]
    for item in items:
        d = blake3.blake3(item).digest()
        for i in range(4):
            out[i] = (out[i] + int.from_bytes(d[4 * i : 4 * i + 4], "little")) % _LANE
    return out


# -- internals ----------------------------------------------------------------------------------
def _merged(key: str, parts: Iterable[Part]) -> tuple[ChunkRef, ...]:
    return tuple(sorted((c for p in parts for c in p.pieces.get(key, ())), key=lambda c: c.offsets))


def _with_chunks(t: TensorEntry, chunks: tuple[ChunkRef, ...]) -> TensorEntry:
    return TensorEntry(t.dtype, t.shape, chunks, t.block, container=t.container, device=t.device)


def _document(
    raw: bytes, where: str, fmt: str, versions: tuple[int, ...] = (VERSION,)
) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptionError(f"{where}: {len(raw)} bytes exceeds the manifest limit")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptionError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CorruptionError(f"{where} is not a {fmt} object")
    version = doc.get("version")
    if version not in versions:
        later = type(version) is int and version > max(versions)
        raise CorruptionError(
            f"{where} has version {version!r}; this ckstore reads {list(versions)}"
            + (": upgrade ckstore to read it" if later else "")
        )
    return doc


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)
