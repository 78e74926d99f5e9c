"""PyTorch DCP checkpoint directories (``torch.distributed.checkpoint`` with its FileSystemWriter), in and out.

Import reads a directory written by any number of ranks in one process. DCP's ``.metadata`` is
unpickled with DCP's metadata classes only, and its ``BYTE_IO`` values weights-only (DCP's own
reader would unpickle both without limits); the tensor data is read by DCP's FileSystemReader
and planner into global tensors (from a :class:`Spill`, so a checkpoint larger than the memory
budget goes through temporary files). DCP's flattening map (``planner_data``) rebuilds the
nested state dict; its top-level keys become apps. The chunks each tensor was saved in (the
ranks' shards) are kept in the import record.

Export runs ``dcp.save`` in one process with DCP's own FileSystemWriter, so DCP reads the
directory at any world size. A planner reads each write item's region from the snapshot when
DCP asks for it (verified chunks): tensors imported from DCP are written in their original
shards, other tensors whole, or in row blocks when larger than the memory budget. DCP's writer
holds every tensor of a file until the file is closed, so a checkpoint larger than the budget
is written one file per item (one item in memory at a time).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from typing import Any

import torch

from ..engine.restore.reader import Reader
from ..engine.view import SnapshotView
from ..errors import InvalidInputError
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.manifest import TensorEntry
from ..format.tree import unflatten
from ._apps import app_state_of, is_flat
from ._read import app_trees, entry_of, slabs
from ._safeload import load_dcp_metadata, load_dcp_value
from ._source import Source
from ._spill import Spill

METADATA_NAME = ".metadata"


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


# --- import --------------------------------------------------------------------------------------
def import_dir(path: str, spill: Spill) -> tuple[dict[str, Any], Source]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = os.path.join(path, METADATA_NAME)
    md = load_dcp_metadata(where)
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel != os.path.basename(rel) or rel in (".", ".."):
            raise InvalidInputError(
                f"{where}: data file {rel!r} is not a file name inside the checkpoint"
            )
    flat: dict[str, Any] = {}
    chunks: dict[str, list[list[list[int]]]] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dtype_name(m.properties.dtype, fqn)
            boxes = [[list(c.offsets), list(c.sizes)] for c in m.chunks]
            if not _tile_exactly(boxes, tuple(m.size)):  # before any allocation
                raise InvalidInputError(
                    f"{where}: the chunks of {fqn!r} do not tile its declared shape {list(m.size)} "
                    f"exactly ({len(boxes)} chunk(s)); the checkpoint is damaged or was not written by DCP"
                )
            flat[fqn] = spill.empty(m.properties.dtype, tuple(m.size))
            if len(m.chunks) > 1:
                chunks[fqn] = [[list(c.offsets), list(c.sizes)] for c in m.chunks]
        else:
            flat[fqn] = None
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp().load(
                flat,
                storage_reader=_reader_class()(path),
                planner=_planner_class()(path),
                no_dist=True,
            )
    except CheckpointException as exc:  # a BaseException: it would pass every `except Exception`
        raise _read_failed(path, exc) from exc
    nested = _unflatten(flat, md.planner_data)
    src = Source(
        "dcp",
        os.path.basename(os.path.abspath(path)),
        "model" if is_flat(nested) else None,
        dcp_chunks=chunks,
    )
    return app_state_of(nested, path), src


MAX_CELLS = 1 << 22
"""Most cells of the grid the chunk boundaries of one imported tensor make (its tiling check
marks each cell once); a checkpoint past it is refused."""


def _tile_exactly(boxes: list[list[list[int]]], shape: tuple[int, ...]) -> bool:
    """True if ``boxes`` lie inside ``shape``, do not overlap, and cover it whole: each box is
    marked on the grid of every chunk boundary, and no cell is marked twice or left out."""
    import bisect

    import numpy as np

    if not _tiles(boxes, shape):
        return False
    if math.prod(shape) == 0:
        return True
    cuts = [
        sorted({0, n} | {o for o, _ in dims} | {o + k for o, k in dims})
        for n, dims in zip(shape, zip(*[list(zip(offs, sizes)) for offs, sizes in boxes]))
    ]
    if math.prod(len(c) - 1 for c in cuts) > MAX_CELLS:
        return False
    seen = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for offs, sizes in boxes:
        if 0 in sizes:
            continue
        box = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + k))
            for c, o, k in zip(cuts, offs, sizes)
        )
        if seen[box].any():
            return False
        seen[box] = True
    return bool(seen.all())


def _read_failed(path: str, exc: BaseException) -> InvalidInputError:
    """DCP's ``CheckpointException`` (per-rank failures) as the import's typed error."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), exc)
    cause = getattr(first, "exc", first)  # DCP wraps each rank's error with its traceback
    return InvalidInputError(
        f"{path}: the DCP checkpoint's data could not be read ({type(cause).__name__}: {cause}); "
        "a .distcp file is missing, truncated or does not match .metadata"
    )


def _reader_class() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        """DCP's reader, with its metadata unpickled by the restricted loader."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise InvalidInputError("rank-local DCP metadata is not supported")
            md = load_dcp_metadata(os.path.join(str(self.path), METADATA_NAME))
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = self.load_id
            return md

    return _Reader


def _planner_class() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        """Loads into a flat fqn -> tensor dict; values are loaded weights-only."""

        def __init__(self, where: str) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.where = where

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            self.state_dict[fqn] = load_dcp_value(value, fqn, self.where)

    return _Planner


def _unflatten(flat: dict[str, Any], mapping: Any) -> dict[str, Any]:
    """Rebuild DCP's nested state dict from its flat fqns (DCP's ``set_element`` rules).

    ``mapping`` (DCP's ``planner_data``) comes from the checkpoint's ``.metadata``: unless it
    is a consistent nesting (every path of str keys and list indexes, no index past the number
    of leaves, no leaf that is also a container), the flat fqns are kept as they are.
    """
    if not _nesting_ok(flat, mapping):
        return flat
    root: dict[str, Any] = {}
    for fqn, path in mapping.items():
        node: Any = root
        for here, nxt in zip(path, path[1:]):
            fresh: Any = {} if isinstance(nxt, str) else []
            if isinstance(node, dict):
                node = node.setdefault(here, fresh)
            else:
                while len(node) <= here:
                    node.append(None)
                if node[here] is None:
                    node[here] = fresh
                node = node[here]
        last = path[-1]
        if isinstance(node, dict):
            node[last] = flat[fqn]
        else:
            while len(node) <= last:
                node.append(None)
            node[last] = flat[fqn]
    return root


def _nesting_ok(flat: dict[str, Any], mapping: Any) -> bool:
    """Whether ``mapping`` nests ``flat``'s fqns without conflicts and within bounds."""
    if not isinstance(mapping, dict) or set(mapping) != set(flat):
        return False
    kinds: dict[tuple[Any, ...], str] = {}  # path prefix -> "dict", "list" or "leaf"
    for path in mapping.values():
        if not isinstance(path, tuple) or not path or not isinstance(path[0], str):
            return False  # the root is a dict
        for i, part in enumerate(path):
            if isinstance(part, bool) or not isinstance(part, (str, int)):
                return False
            if isinstance(part, int) and not 0 <= part < len(
                mapping
            ):  # a list holds a leaf per index at most
                return False
            kind = (
                "leaf"
                if i == len(path) - 1
                else ("dict" if isinstance(path[i + 1], str) else "list")
            )
            if kinds.setdefault(path[: i + 1], kind) != kind:
                return False  # one place both a leaf and a container, or both a dict and a list
    return True


# --- export --------------------------------------------------------------------------------------
def export(
    view: SnapshotView, out: str, keys: list[str], src: Source | None, budget: int
) -> dict[str, Any]:
    """``dcp.save`` the selected keys into ``out`` (one process; readable at any world size)."""
    key_of: dict[int, str] = {}
    placeholders: list[torch.Tensor] = []

    def resolve(key: str) -> Any:
        entry = entry_of(view, key)
        if isinstance(entry, TensorEntry):
            t = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
            key_of[id(t)] = key
            placeholders.append(t)
            return t
        return entry.value

    objs = {app: unflatten(tree, resolve) for app, tree in app_trees(view, keys).items()}
    from ._torchfile import export_object

    state = export_object(objs, src)
    if not isinstance(state, dict):
        state = {"model": state}
    layout = src.dcp_chunks if src is not None else {}
    planner = _save_planner_class()(view, key_of, layout, budget)
    # DCP's writer keeps every tensor of a file until the file is done: past the budget, one
    # file per write item keeps one item in memory at a time.
    total = sum(math.prod(t.shape) * t.element_size() for t in placeholders)
    writer = _dcp().FileSystemWriter(
        out, thread_count=1, sync_files=True, single_file_per_rank=total <= budget
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp().save(state, storage_writer=writer, planner=planner, no_dist=True)
    return {"files": sorted(os.listdir(out)), "tensors": len(placeholders)}


def _save_planner_class() -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItemType

    class _Planner(DefaultSavePlanner):
        """Plans over meta placeholders; ``resolve_data`` reads each item's region from the snapshot."""

        def __init__(
            self, view: SnapshotView, key_of: dict[int, str], layout: dict[str, Any], budget: int
        ) -> None:
            super().__init__(dedup_save_to_lowest_rank=False)
            self.view = view
            self.reader = Reader.of(view)
            self.key_of = key_of
            self.layout = layout
            self.budget = budget

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    items.append(item)
                    continue
                items.extend(self._split(item))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def _split(self, item: Any) -> list[Any]:
            fqn = item.index.fqn
            key = self.key_of[id(self.state_dict[fqn])]
            boxes = self.layout.get(fqn)
            if boxes is None or not _tiles(boxes, tuple(item.tensor_data.size)):
                entry = self.view.manifest.entries[key]
                assert isinstance(entry, TensorEntry)
                regions = slabs(entry, self.budget)
                if regions == [None]:
                    return [item]
                boxes = [[list(r[0]), list(r[1])] for r in regions if r is not None]
            out = []
            for offs, sizes in boxes:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes))
                out.append(
                    dataclasses.replace(
                        item,
                        index=MetadataIndex(fqn, torch.Size(offs)),
                        type=WriteItemType.SHARD,
                        tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk),
                    )
                )
            return out

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            key = self.key_of[id(self.state_dict[write_item.index.fqn])]
            chunk = write_item.tensor_data.chunk
            region = (tuple(chunk.offsets), tuple(chunk.sizes))
            return self.reader.read_regions({key: region})[key]

    return _Planner


def _tiles(boxes: Any, shape: tuple[int, ...]) -> bool:
    """True if ``boxes`` (``[[offsets, sizes], ...]``) lie inside ``shape`` and add up to its volume."""
    try:
        total = 0
        for offs, sizes in boxes:
            if len(offs) != len(shape) or len(sizes) != len(shape):
                return False
            if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, sizes, shape)):
                return False
            total += math.prod(sizes)
        return total == math.prod(shape)
    except (TypeError, ValueError):
        return False
