"""A distributed take's manifest in parts (docs/FORMAT.md, section 7.7): what each rank
records, what the ranks add up, and the root rank 0 commits.

No rank receives another rank's entries:

* each rank stores its :class:`~ckstore.format.parts.Part` (its pieces of the sharded tensors,
  its own value of each per-rank entry that differs between ranks, its write figures) as a
  chunk, pins every chunk the part names to the take's staging session (rank 0's; the commit
  turns its pins into the snapshot's chunk references), and sends rank 0 the part's id and
  size and the ids of the replicated pieces it wrote (:class:`Record`: 40 bytes, plus 32 per
  replicated piece; the root lists those);
* per key, the ranks add up what the index and the header need (:func:`sums`): the lanes of
  the entries' digests and the per-rank sizes, the health figures, and whether each rank's
  share is what the run's latest snapshot held: three all-reduces of O(keys) values;
* rank 0 builds the root from its own leaves and those sums (:func:`root_of`), stores the
  nodes above the parts as chunks and the root as the manifest object, and commits.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..engine.take.guard import FIGURES, Summed, TakeGuard
from ..engine.take.packing import TakeOptions
from ..errors import DistributedError
from ..format.dtypes import itemsize
from ..format.grid import Box, make_grid
from ..format.layout import Layout
from ..format.manifest import (
    ChunkRef,
    Entry,
    TensorEntry,
    ValueEntry,
    canonical_json,
    entry_digest,
)
from ..format.parts import Level, Part, Root, Shell, own_lanes, piece_lanes, shell_digest
from ..index import EntryRecord
from ._classify import DTENSOR, LOCAL, REPLICATED, VALUE, Local
from ._plan import Agreed, ints62, same, shares

SHARDED, PER_RANK, ROOT = "sharded", "per_rank", "root"
INTS = 6 + FIGURES  # per key: 4 digest lanes, per-rank bytes, per-rank tensor bytes, figures
TOTALS = ("new_bytes", "new_chunks", "reused_chunks")


@dataclass(frozen=True)
class Record:
    """What a rank sends rank 0: its part's id and size, and the ids of the replicated pieces
    it wrote, in the order of its share (``_plan.replicated_share``)."""

    part: str
    size: int
    replicated: tuple[str, ...]

    def to_bytes(self) -> bytes:
        ids = b"".join(bytes.fromhex(x) for x in self.replicated)
        return bytes.fromhex(self.part) + self.size.to_bytes(8, "little") + ids

    @classmethod
    def from_bytes(cls, raw: bytes, rank: int) -> Record:
        if len(raw) < 40 or (len(raw) - 40) % 32:
            raise DistributedError(f"distributed take: rank {rank} sent a malformed record")
        ids = tuple(raw[i : i + 32].hex() for i in range(40, len(raw), 32))
        return cls(raw[:32].hex(), int.from_bytes(raw[32:40], "little"), ids)


def where_of(local: Local, key: str, equal: set[str]) -> str:
    """Where a key's entry lives: in the parts (a sharded tensor, or per rank) or the root."""
    kind = local.leaves[key].kind
    if kind == DTENSOR:
        return SHARDED
    if kind in (LOCAL, VALUE) and key not in equal:
        return PER_RANK
    return ROOT


# -- agreement on layouts and on the staging session (in the hash phase's all-reduce) ----------
def layout_vector(local: Local) -> list[int]:
    """Per sharded key: whether this rank's layout failed to give its box, and its digest."""
    out: list[int] = []
    for leaf in local.leaves.values():
        if leaf.kind == DTENSOR:
            d = ints62(canonical_json(leaf.layout.to_dict()))[0] if leaf.layout else 0
            out += [int(leaf.layout is None), d, -d]
    return out


def located(local: Local, maxed: list[int]) -> dict[str, Layout]:
    """The sharded keys whose layout every rank shares and that gives every rank's box."""
    out, at = {}, 0
    for key, leaf in local.leaves.items():
        if leaf.kind == DTENSOR:
            if not maxed[at] and same(maxed, at + 1) and leaf.layout is not None:
                out[key] = leaf.layout
            at += 3
    return out


def session_vector(*sessions: str | None) -> list[int]:
    """Rank 0's session ids (its staging session's, its own), four ints each (every other
    rank: zeros, so the maximum is rank 0's)."""
    out = []
    for session in sessions:
        if session is None:
            out += [0, 0, 0, 0]
        elif len(session) != 32:
            raise DistributedError(f"distributed take: unexpected session id {session!r}")
        else:
            out += [int(session[i : i + 8], 16) for i in range(0, 32, 8)]
    return out


def session_of(maxed: list[int]) -> str:
    return "".join(f"{x:08x}" for x in maxed)


# -- this rank's part ---------------------------------------------------------------------------
def part_of(
    rank: int, local: Local, own: dict[str, Entry], equal: set[str], figures: dict[str, int]
) -> Part:
    """This rank's part: its pieces of the sharded tensors, its own per-rank values."""
    pieces: dict[str, list[ChunkRef]] = defaultdict(list)
    for key, (o, s), c in local.chunks:
        if local.leaves[key].kind == DTENSOR:
            pieces[key].append(ChunkRef(tuple(o), tuple(s), c.id, c.check or None))
    mine = {k: e for k, e in own.items() if k not in equal}
    return Part(
        rank,
        {k: tuple(sorted(v, key=lambda c: c.offsets)) for k, v in pieces.items()},
        mine,  # type: ignore[arg-type]  # own entries are tensors or values
        figures,
    )


def named_chunks(part: Part) -> set[str]:
    """Every chunk a part names."""
    out = {c.id for refs in part.pieces.values() for c in refs}
    for e in part.own.values():
        if isinstance(e, TensorEntry):
            out.update(c.id for c in e.chunks)
    return out


def replicated_ids(local: Local, mine: tuple[tuple[str, Box], ...]) -> tuple[str, ...]:
    """The ids of the replicated pieces this rank wrote, in the order of its share."""
    ids = {(k, tuple(o), tuple(s)): c.id for k, (o, s), c in local.chunks}
    return tuple(
        ids[(k, tuple(o), tuple(s))] for k, (o, s) in mine if local.leaves[k].kind == REPLICATED
    )


# -- what the ranks add up ----------------------------------------------------------------------
def sums(
    guard: TakeGuard,
    local: Local,
    own: dict[str, Entry],
    equal: set[str],
    part: Part,
    rank: int,
    world: int,
    totals: dict[str, int],
    opts: TakeOptions,
) -> tuple[list[int], list[float], list[int]]:
    """This rank's contribution, per key in the leaves' order (the same on every rank): ints to
    sum (:data:`INTS` per key, then the write totals), floats to sum (a sum of squares per key)
    and ints to max (per key: whether this rank's share differs from the run's latest
    snapshot, and a per-rank value's dtype and shape as ``x, -x``)."""
    hashed: dict[str, list[str]] = defaultdict(list)
    for key, _, c in local.chunks:
        hashed[key].append(c.id)
    ints: list[int] = []
    floats: list[float] = []
    maxes: list[int] = []
    for key, leaf in local.leaves.items():
        at = where_of(local, key, equal)
        lanes, nbytes, tensor_bytes, differs, kind = [0] * 4, 0, 0, 0, 0
        figures, sumsq = [0] * FIGURES, 0.0
        dtype = leaf.desc.get("dtype", "")
        if at == SHARDED:
            refs = part.pieces.get(key, ())
            lanes = piece_lanes(refs)
            figures, sumsq = guard.local_figures(dtype, (c.id for c in refs))
            differs = int(guard.differs(key, _shell_tensor(leaf.desc, refs, opts)))
        elif at == PER_RANK:
            e = own[key]
            assert isinstance(e, (TensorEntry, ValueEntry))
            lanes, nbytes = own_lanes(rank, e), e.nbytes
            if isinstance(e, TensorEntry):
                tensor_bytes = e.nbytes
                figures, sumsq = guard.local_figures(
                    e.dtype, (c.id for c in e.chunks), e.data if e.inline else None
                )
            differs = int(guard.differs(key, e, rank, world))
            kind = ints62(canonical_json([e.dtype, e.shape]))[0]
        elif leaf.kind == REPLICATED and "data" not in leaf.desc:
            figures, sumsq = guard.local_figures(dtype, hashed.get(key, ()))
        elif rank == 0 and isinstance(own.get(key), TensorEntry):  # equal everywhere: rank 0's
            e = own[key]
            assert isinstance(e, TensorEntry)
            figures, sumsq = guard.local_figures(
                e.dtype, (c.id for c in e.chunks), e.data if e.inline else None
            )
        elif rank == 0 and leaf.kind == REPLICATED:  # inline: rank 0's leaf
            figures, sumsq = guard.local_figures(dtype, data=base64.b64decode(leaf.desc["data"]))
        ints += [*lanes, nbytes, tensor_bytes, *figures]
        floats.append(sumsq)
        maxes += [differs, kind, -kind]
    ints += [totals[k] for k in TOTALS]
    return ints, floats, maxes


# -- the root (rank 0) --------------------------------------------------------------------------
@dataclass
class Committable:
    """What rank 0 commits: the root, its index rows and the chunks it names itself."""

    root: Root
    entries: list[EntryRecord]
    chunk_ids: list[str]
    logical_bytes: int
    figures: dict[str, int]


def root_of(
    guard: TakeGuard,
    local: Local,
    own: dict[str, Entry],
    equal: set[str],
    layouts: dict[str, Layout],
    agreed: Agreed,
    records: list[Record],
    tree: tuple[Level, list[str]],
    summed: tuple[list[int], list[float], list[int]],
    header: Any,
    opts: TakeOptions,
) -> Committable:
    """The root of the take (on rank 0) from its own leaves, every rank's record and the sums.

    ``tree``: the root's level over the parts and the ids of the nodes below it; ``header``:
    called with the keys and the :class:`Summed` figures, returns the snapshot header (the
    guard applies its policies there: ``NonFiniteError``, ``StaleStateError``).
    """
    world = len(records)
    ints, floats, maxes = summed
    replicated = _replicated(local, agreed, records, world, opts)
    order = {m: i for i, m in enumerate(dict.fromkeys(layouts.values()))}
    entries: dict[str, Entry] = {}
    shells: dict[str, Shell] = {}
    rows: list[EntryRecord] = []
    tensors, unchanged = {}, set()
    logical = 0
    for n, (key, leaf) in enumerate(local.leaves.items()):
        at = where_of(local, key, equal)
        lanes = ints[INTS * n : INTS * n + 4]
        nbytes, tensor_bytes = ints[INTS * n + 4], ints[INTS * n + 5]
        differs = maxes[3 * n]
        if at == SHARDED:
            layout = layouts.get(key)
            shell = Shell(
                _shell_tensor(leaf.desc, (), opts), None if layout is None else order[layout]
            )
            shells[key] = shell
            t = shell.tensor
            assert t is not None
            logical += t.nbytes
            rows.append(
                EntryRecord(key, "tensor", t.dtype, t.shape, t.nbytes, shell_digest(shell, lanes))
            )
        elif at == PER_RANK:
            shells[key] = Shell(None)
            mine = own[key]
            common = same(maxes, 3 * n + 1)
            logical += tensor_bytes
            rows.append(
                EntryRecord(
                    key,
                    "per_rank",
                    mine.dtype if common else None,
                    mine.shape if common else None,
                    nbytes,
                    shell_digest(Shell(None), lanes),
                )
            )
        else:
            e = replicated.get(key) or own[key]
            entries[key] = e
            differs = int(guard.differs(key, e)) if isinstance(e, TensorEntry) else 1
            logical += e.nbytes if isinstance(e, TensorEntry) else 0
            rows.append(EntryRecord(key, e.kind, e.dtype, e.shape, e.nbytes, entry_digest(e)))
        if not differs:
            unchanged.add(key)
        found = guard.summed(key, ints[INTS * n + 6 : INTS * (n + 1)], floats[n], not differs)
        if found is not None:
            tensors[key] = found
    totals = dict(zip(TOTALS, ints[INTS * len(local.leaves) :]))
    snapshot = header(list(local.leaves), Summed(tensors, frozenset(unchanged)))
    level, nodes = tree
    root = Root(local.apps, entries, shells, tuple(order), level, snapshot)
    named = {c.id for e in entries.values() if isinstance(e, TensorEntry) for c in e.chunks}
    named |= {r.part for r in records} | set(nodes)
    return Committable(root, rows, sorted(named), logical, totals)


def _replicated(
    local: Local, agreed: Agreed, records: list[Record], world: int, opts: TakeOptions
) -> dict[str, TensorEntry]:
    """Every replicated tensor's entry: inline from rank 0's leaf, or its pieces' ids from the
    records of the ranks that wrote them."""
    pieces: dict[str, list[ChunkRef]] = defaultdict(list)
    for r, share in enumerate(shares(local, agreed, world, opts)):
        ids = records[r].replicated
        if len(ids) != len(share):
            raise DistributedError(
                f"distributed take: rank {r} wrote {len(ids)} replicated pieces, not {len(share)}"
            )
        for (key, (o, s)), cid in zip(share, ids):
            pieces[key].append(ChunkRef(tuple(o), tuple(s), cid))
    out = {}
    for key in agreed.replicated:
        x = local.leaves[key].desc
        if "data" in x:
            out[key] = TensorEntry(
                x["dtype"],
                tuple(x["shape"]),
                data=base64.b64decode(x["data"]),
                container=x["container"],
                device=x["device"],
            )
        else:
            refs = tuple(sorted(pieces[key], key=lambda c: c.offsets))
            out[key] = _with(_shell_tensor(x, (), opts), refs)
    return out


def _shell_tensor(x: dict[str, Any], refs: tuple[ChunkRef, ...], opts: TakeOptions) -> TensorEntry:
    """A chunked tensor's entry from a leaf's description, on the store's grid."""
    shape = tuple(x["shape"])
    block = make_grid(shape, itemsize(x["dtype"]), opts.chunk_bytes).block
    return TensorEntry(x["dtype"], shape, refs, block, container=x["container"], device=x["device"])


def _with(t: TensorEntry, refs: tuple[ChunkRef, ...]) -> TensorEntry:
    return TensorEntry(t.dtype, t.shape, refs, t.block, container=t.container, device=t.device)
