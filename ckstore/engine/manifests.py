"""A committed snapshot's manifest, read from the store: one object, or a root and its parts.

A version 1 manifest is one object (``manifests/<id>``). A version 2 manifest
(``format/parts.py``, docs/FORMAT.md section 7.7) is a root object of that name whose parts and
nodes are chunks: they are read like any chunk (located through the index, every byte
re-hashed against its id), whole (:func:`load`: every part) or for one rank's regions
(:func:`parts_for` says which parts cover them, :func:`read_parts` reads only those and the
nodes above them). Every object read is checked against the id it was named by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from .. import objects
from ..errors import CorruptionError
from ..format.dtypes import itemsize
from ..format.grid import Box, Grid
from ..format.manifest import Manifest
from ..format.parts import Level, Part, Root, assemble, parse_any, parse_node, partial
from .locations import read_following, to_location

if TYPE_CHECKING:
    from .interfaces import LocationIndex

ReadChunks = Callable[[list[str]], Mapping[str, bytes]]
"""Reads chunks by id (each verified against it); returns their bytes by id."""


def load(objs: objects.ObjectStore, index: LocationIndex, raw: bytes, where: str) -> Manifest:
    """The whole manifest from its object's bytes ``raw``: as stored (version 1), or assembled
    from the root and every part (version 2), validated either way."""
    doc = parse_any(raw, where)
    if isinstance(doc, Manifest):
        return doc
    parts, ids = read_parts(doc, range(doc.world), chunk_reader(objs, index, where), where)
    return assemble(doc, [parts[r] for r in range(doc.world)], ids, where)


def open_partial(
    objs: objects.ObjectStore,
    index: LocationIndex,
    raw: bytes,
    where: str,
    rank: int,
    regions: Mapping[str, Box | None],
) -> Manifest:
    """Rank ``rank``'s view of a manifest (:func:`~ckstore.format.parts.partial`): only the
    parts covering ``regions`` (key -> region, None: the whole tensor) are read. A version 1
    manifest is read whole."""
    doc = parse_any(raw, where)
    if isinstance(doc, Manifest):
        return doc
    wanted = parts_for(doc, rank, regions)
    parts, ids = read_parts(doc, wanted, chunk_reader(objs, index, where), where)
    return partial(doc, parts, rank, ids)


def parts_for(root: Root, rank: int, regions: Mapping[str, Box | None]) -> set[int]:
    """The parts that hold what rank ``rank`` needs of ``regions`` (key -> region of the
    global tensor, None: all of it): the writers of the pieces overlapping each region of a
    sharded tensor whose layout says where they are (every part for one whose does not), and
    the rank's own part for its per-rank values."""
    out: set[int] = set()
    for key, region in regions.items():
        shell = root.shells.get(key)
        if shell is None:
            continue
        t = shell.tensor
        if t is None:
            if rank < root.world:
                out.add(rank)
            continue
        if shell.layout is None:
            return set(range(root.world))
        box = region if region is not None else ((0,) * len(t.shape), t.shape)
        grid = Grid(t.shape, itemsize(t.dtype), t.block or ())
        out |= root.layouts[shell.layout].writers(key, grid, box)
    return out


def read_parts(
    root: Root, wanted: Iterable[int], read: ReadChunks, where: str
) -> tuple[dict[int, Part], list[str]]:
    """Parts ``wanted`` of ``root`` (by rank), reading only the nodes above them; and the ids
    of every object read. Each level is read in one batch."""
    wanted = sorted(set(wanted))
    bad = [p for p in wanted if not 0 <= p < root.world]
    if bad:
        raise CorruptionError(f"{where}: no part {bad[0]} among {root.world}")
    levels = [root.parts]
    ids: list[str] = []
    while levels[0].span > 1:  # one level of nodes at a time, only those above wanted parts
        above = {(lv, lv.child_of(p)) for lv in levels for p in wanted if _under(lv, p)}
        todo = sorted(above, key=lambda x: (x[0].first, x[1]))
        got = read([lv.children[j][0] for lv, j in todo])
        nxt = []
        for lv, j in todo:
            cid, size = lv.children[j]
            raw = _sized(got, cid, size, where)
            first, count = lv.child_parts(j)
            nxt.append(parse_node(raw, f"{where}, node {cid[:12]}", first, count, lv.span))
            ids.append(cid)
        levels = nxt
    named = {p: lv.children[p - lv.first] for lv in levels for p in wanted if _under(lv, p)}
    got = read(sorted({cid for cid, _ in named.values()}))
    parts = {}
    for p, (cid, size) in named.items():
        parts[p] = Part.from_json(_sized(got, cid, size, where), f"{where}, part {p}", p, root)
    ids.extend(sorted({cid for cid, _ in named.values()}))
    return parts, ids


def chunk_reader(objs: objects.ObjectStore, index: LocationIndex, where: str) -> ReadChunks:
    """Reads chunks by id through the index's locations (each re-hashed against its id)."""

    def read(ids: list[str]) -> dict[str, bytes]:
        if not ids:
            return {}
        known = index.chunk_locations(ids)
        out = {}
        for cid in ids:
            rec = known.get(cid)
            if rec is None:
                raise CorruptionError(f"{where}: manifest part {cid[:16]}… has no chunk row")
            out[cid] = bytes(  # moved meanwhile (compaction, gc): followed to its place
                read_following(index.chunk_locations, to_location(rec, known), objs.read_chunk)
            )
        return out

    return read


def _under(level: Level, part: int) -> bool:
    return level.first <= part < level.first + level.count


def _sized(got: Mapping[str, bytes], cid: str, size: int, where: str) -> bytes:
    raw = got.get(cid)
    if raw is None or len(raw) != size:
        raise CorruptionError(
            f"{where}: manifest object {cid[:16]}… is {None if raw is None else len(raw)} bytes, "
            f"its parent says {size}"
        )
    return raw
