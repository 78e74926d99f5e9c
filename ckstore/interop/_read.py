"""Reading a snapshot for export: tensors in budget-sized pieces, or whole objects rebuilt.

Every read goes through the snapshot's :class:`~ckstore.engine.restore.reader.Reader`, which fetches
each chunk once and re-hashes it against its id (I3): an export never writes bytes that do not
match what was stored.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..engine.restore.reader import Reader
from ..engine.view import SnapshotView
from ..errors import UnsupportedValueError
from ..format.dtypes import dtype_from_name
from ..format.manifest import Entry, PerRankEntry, TensorEntry, ValueEntry
from ..format.tensors import byte_view
from ..format.tree import unflatten
from ._apps import SOURCE_APP
from ._spill import Spill

Region = tuple[tuple[int, ...], tuple[int, ...]]


def entry_of(view: SnapshotView, key: str) -> TensorEntry | ValueEntry:
    """The entry of ``key``; per-rank entries (values that differed between ranks) are refused."""
    entry: Entry = view.manifest.entries[key]
    if isinstance(entry, PerRankEntry):
        raise UnsupportedValueError(
            f"snapshot {view.ref}: key {key!r} holds one value per rank (a distributed take in "
            f"which it differed between {entry.world_size} ranks); a checkpoint file holds one. "
            "Leave it out with --keys, or read each rank's value with read_object()"
        )
    return entry


def slabs(entry: TensorEntry, budget: int) -> list[Region | None]:
    """The regions to read a tensor in so that each stays near ``budget`` bytes (None: whole)."""
    if entry.nbytes <= budget or len(entry.shape) == 0 or entry.shape[0] <= 1:
        return [None]
    rows = entry.shape[0]
    row_bytes = max(1, entry.nbytes // rows)
    step = max(1, budget // row_bytes)
    rest = tuple(entry.shape[1:])
    zeros = (0,) * len(rest)
    return [((r, *zeros), (min(step, rows - r), *rest)) for r in range(0, rows, step)]


def tensor_bytes(
    reader: Reader, view: SnapshotView, keys: Sequence[str], budget: int
) -> Iterator[tuple[str, memoryview]]:
    """Each key's raw bytes in order, as pieces; about ``budget`` bytes are held at a time."""
    batch: list[str] = []
    held = 0
    for key in keys:
        entry = entry_of(view, key)
        assert isinstance(entry, TensorEntry)
        if entry.nbytes > budget:
            yield from _flush(reader, batch)
            batch, held = [], 0
            for region in slabs(entry, budget):
                part = reader.read_regions({key: region})[key]
                yield key, byte_view(part)
            continue
        if held + entry.nbytes > budget and batch:
            yield from _flush(reader, batch)
            batch, held = [], 0
        batch.append(key)
        held += entry.nbytes
    yield from _flush(reader, batch)


def _flush(reader: Reader, keys: list[str]) -> Iterator[tuple[str, memoryview]]:
    if not keys:
        return
    tensors = reader.read_tensors(keys)
    for key in keys:
        yield key, byte_view(tensors.pop(key))


def prune(tree: Any, keep: set[str]) -> Any:
    """``tree`` with only the leaves in ``keep``; None if nothing selected is left in it.

    A container that loses every one of its children goes too; one that was empty already
    (``[{}]`` in a scheduler's state) stays, as it is part of the selected structure.
    """
    if isinstance(tree, list):
        kept = [k for k in (prune(t, keep) for t in tree) if k is not None]
        return kept if kept or not tree else None
    if "$ref" in tree:
        return tree if tree["$ref"] in keep else None
    if "$tuple" in tree:
        kids = [k for k in (prune(t, keep) for t in tree["$tuple"]) if k is not None]
        return {"$tuple": kids} if kids or not tree["$tuple"] else None
    items = [[k, c] for k, c in ((k, prune(v, keep)) for k, v in tree["$dict"]) if c is not None]
    return {**tree, "$dict": items} if items or not tree["$dict"] else None


def app_trees(view: SnapshotView, keys: Sequence[str]) -> dict[str, Any]:
    """App -> its container tree narrowed to ``keys`` (the import record left out)."""
    keep = set(keys)
    out = {}
    for app, tree in view.manifest.apps.items():
        if app == SOURCE_APP:
            continue
        pruned = prune(tree, keep)
        if pruned is not None:
            out[app] = pruned
    return out


def build_objects(
    view: SnapshotView, keys: Sequence[str], spill: Spill, reader: Reader
) -> dict[str, Any]:
    """App -> its state rebuilt (plain values and CPU tensors) from the selected keys.

    Tensors are allocated from ``spill`` (memory up to its budget, temporary files past it)
    and filled in budget-sized batches, every chunk verified.
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    batch: dict[str, tuple[torch.Tensor, Region | None]] = {}
    held = 0
    for key in keys:
        entry = entry_of(view, key)
        if isinstance(entry, ValueEntry):
            values[key] = entry.value
            continue
        t = tensors[key] = spill.empty(dtype_from_name(entry.dtype), entry.shape)
        if entry.nbytes > spill.budget:  # a big tensor: read in slabs straight into place
            for region in slabs(entry, spill.budget):
                part = t if region is None else t[tuple(slice(o, o + n) for o, n in zip(*region))]
                reader.read_into({key: (part, region)})
            continue
        if held + entry.nbytes > spill.budget and batch:
            reader.read_into(batch)
            batch, held = {}, 0
        batch[key] = (t, None)
        held += entry.nbytes
    reader.read_into(batch)

    def resolve(key: str) -> Any:
        if key in values:
            return values[key]
        entry = view.manifest.entries[key]
        t = tensors[key]
        return t.numpy() if isinstance(entry, TensorEntry) and entry.container == "numpy" else t

    return {app: unflatten(tree, resolve) for app, tree in app_trees(view, keys).items()}
