"""A DCP save's data: write items cut on the global chunk grid, chunk owners, manifest entries."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..engine.take.packing import Chunk, TakeOptions
from ..errors import CorruptionError, DistributedError, InvalidInputError, UnsupportedValueError
from ..format.boxes import pieces
from ..format.dtypes import GROUPED, dtype_name, itemsize
from ..format.grid import Box, make_grid
from ..format.manifest import ChunkRef, Entry, TensorEntry, ValueEntry, canonical_json
from ..format.tensors import as_cpu_tensor, byte_view
from ..format.tree import join
from ..format.values import encode_value
from .meta import ints

APP = "dcp"


def cut_items(
    items: list[WriteItem], planner: SavePlanner, opts: TakeOptions
) -> tuple[list[WriteResult], list[Chunk]]:
    """Per item: its pieces on the global grid (tensors) or its JSON value (everything else).

    Returns the WriteResults (piece ids filled in later by :func:`fill_ids`) and the chunks.
    """
    results: list[WriteResult] = []
    chunks: list[Chunk] = []
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            if not callable(lookup):
                raise UnsupportedValueError(
                    f"key {fqn!r}: ckstore stores DCP's non-tensor values as JSON and needs a planner with "
                    "lookup_object() (DefaultSavePlanner or a subclass); it never stores pickled bytes"
                )
            encoded = encode_value(lookup(item.index), fqn)
            results.append(
                WriteResult(item.index, len(canonical_json(encoded)), {"value": encoded})
            )
            continue
        td = item.tensor_data
        if td is None:
            raise InvalidInputError(f"key {fqn!r}: DCP write item without tensor data")
        data = planner.resolve_data(item)
        t = as_cpu_tensor(data, fqn)
        name = dtype_name(t.dtype, fqn)
        if t.dtype != td.properties.dtype:
            raise InvalidInputError(
                f"key {fqn!r}: DCP planned {td.properties.dtype}, resolve_data gave {t.dtype}"
            )
        box: Box = (tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
        if tuple(t.shape) != box[1]:
            raise InvalidInputError(
                f"key {fqn!r}: DCP planned a {list(box[1])} shard, resolve_data gave {list(t.shape)}"
            )
        grid = make_grid(tuple(int(s) for s in td.size), t.element_size(), opts.chunk_bytes)
        mine: list[list[Any]] = []
        for po, ps in pieces(grid, box):
            sub = t[tuple(slice(o - b, o - b + s) for o, b, s in zip(po, box[0], ps))]
            chunks.append(Chunk(fqn, byte_view(sub), t.element_size(), name in GROUPED))
            mine.append([list(po), list(ps), ""])
        results.append(
            WriteResult(
                item.index, math.prod(box[1]) * t.element_size(), {"dtype": name, "pieces": mine}
            )
        )
    return results, chunks


def fill_ids(results: list[WriteResult], chunks: list[Chunk]) -> None:
    """Write each hashed chunk's id and check into its piece of the results, in the order
    they were cut."""
    it = iter(chunks)
    for r in results:
        for piece in r.storage_data.get("pieces", ()):
            c = next(it)
            piece[2:] = [c.id, c.check] if c.check else [c.id]


def id_sizes(chunks: list[Chunk]) -> list[list[Any]]:
    return sorted({c.id: len(c.view) for c in chunks}.items())  # type: ignore[arg-type]


def the_coordinator(gathered: list[dict[str, Any]]) -> int:
    ranks = [r for r, g in enumerate(gathered) if g.get("coordinator")]
    if len(ranks) != 1:
        raise DistributedError(
            f"dcp.save into ckstore: {len(ranks)} ranks of the save call themselves DCP's coordinator "
            "(exactly one must: the same coordinator_rank on every rank of the process group)"
        )
    return ranks[0]


def owners(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """One writer per distinct chunk id: its only holder, else the least-loaded holder."""
    holders: dict[str, list[int]] = defaultdict(list)
    size: dict[str, int] = {}
    for r, ids in enumerate(per_rank):
        for cid, n in ids.items():
            holders[cid].append(r)
            size[cid] = n
    load = [0] * len(per_rank)
    owners: dict[str, int] = {}
    for cid, hs in holders.items():
        if len(hs) == 1:
            owners[cid] = hs[0]
            load[hs[0]] += size[cid]
    for cid in sorted(c for c, hs in holders.items() if len(hs) > 1):
        r = min(holders[cid], key=lambda q: (load[q], q))
        owners[cid] = r
        load[r] += size[cid]
    return owners


def manifest_entries(metadata: Metadata, chunk_bytes: int) -> dict[str, Entry]:
    """One manifest entry per DCP key: tensors with the pieces of every rank, values inline."""
    by_fqn: dict[str, list[Any]] = defaultdict(list)
    for index, data in (metadata.storage_data or {}).items():
        by_fqn[index.fqn].append(data)
    entries: dict[str, Entry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        key = join(APP, fqn)
        datas = by_fqn.get(fqn, [])
        if isinstance(md, BytesStorageMetadata):
            if len(datas) != 1 or "value" not in datas[0]:
                raise InvalidInputError(
                    f"dcp.save into ckstore: value key {fqn!r} was written {len(datas)} times"
                )
            entries[key] = ValueEntry(datas[0]["value"])
            continue
        name = dtype_name(md.properties.dtype, fqn)
        shape = tuple(int(s) for s in md.size)
        refs = sorted((piece_ref(p) for d in datas for p in d["pieces"]), key=lambda c: c.offsets)
        entries[key] = TensorEntry(
            name, shape, tuple(refs), make_grid(shape, itemsize(name), chunk_bytes).block
        )
    return entries


def piece_ref(piece: Any) -> ChunkRef:
    """The chunk ref of one piece, ``[offsets, sizes, id(, check)]`` (a manifest built from it
    is validated before it is stored, and a reader validates what it reads).

    Raises:
        CorruptionError: the piece is not such a list.
    """
    if not isinstance(piece, list) or len(piece) not in (3, 4):
        raise CorruptionError(f"a DCP piece {str(piece)[:80]} is not [offsets, sizes, id(, check)]")
    o, s, cid = piece[:3]
    check = piece[3] if len(piece) == 4 else None
    try:
        return ChunkRef(ints(o), ints(s), str(cid), check)
    except (TypeError, ValueError) as exc:
        raise CorruptionError(f"a DCP piece {str(piece)[:80]} is malformed: {exc}") from exc
