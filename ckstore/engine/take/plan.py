"""Planning a take: state dicts flattened into keys, small values inlined, and every larger
tensor cut on the grid in global coordinates into zero-copy chunks (``format/grid``).

The single-process take (``single.py``) and the distributed one (``ckstore.distributed.take``)
both start here; the chunks then go to a :class:`~ckstore.engine.take.local.LocalTake`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...format.dtypes import GROUPED, dtype_name
from ...format.grid import cuts
from ...format.manifest import ChunkRef, Entry, Manifest, TensorEntry, ValueEntry
from ...format.tensors import as_cpu_tensor, byte_view
from ...format.tree import Flat, flatten, is_array
from ...format.values import encode_value
from ..stateful import RNGState, check_app_state
from .deltas import attach_bases
from .device_staging import is_device_tensor
from .packing import Chunk, TakeOptions


@dataclass
class Plan:
    """A take's state planned: apps' trees, entries, the chunks to store and each key's grid
    boxes (the views of ``keepalive`` tensors the chunks point into)."""

    apps: dict[str, Any]
    entries: dict[str, Entry] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Chunk]]] = field(
        default_factory=dict
    )
    keepalive: list[torch.Tensor] = field(default_factory=list)
    tensors: dict[str, tuple[torch.Tensor, str, str]] = field(default_factory=dict)


def state_dicts(app_state: Mapping[str, Any]) -> dict[str, Any]:
    """Call ``state_dict()`` on every stateful in ``app_state``; refuse anything else.

    :class:`RNGState` entries are captured first and put back once the others are done, so
    random numbers drawn inside other ``state_dict()`` calls leave no trace (TorchSnapshot's
    order). The result keeps ``app_state``'s order.
    """
    check_app_state(app_state)
    rng = {name: obj for name, obj in app_state.items() if isinstance(obj, RNGState)}
    captured = {name: obj.state_dict() for name, obj in rng.items()}
    others = {name: obj.state_dict() for name, obj in app_state.items() if name not in rng}
    for name, obj in rng.items():
        obj.load_state_dict(captured[name])  # undo draws made by the other statefuls
    return {name: captured[name] if name in captured else others[name] for name in app_state}


def plan(states: Mapping[str, Any], opts: TakeOptions) -> Plan:
    """Flatten every state and cut its tensors into grid chunks (zero-copy views)."""
    return plan_flats({name: flatten(name, sd) for name, sd in states.items()}, opts)


def plan_flats(flats: Mapping[str, Flat], opts: TakeOptions) -> Plan:
    """:func:`plan` of states flattened already (``format.tree.flatten``, one per app name)."""
    p = Plan(apps={})
    for name, flat in flats.items():
        p.apps[name] = flat.tree
        for key, value in flat.leaves.items():
            if is_array(value):
                _plan_tensor(p, key, value, opts)
            else:
                p.entries[key] = ValueEntry(encode_value(value, key))
    return p


def _plan_tensor(p: Plan, key: str, value: Any, opts: TakeOptions) -> None:
    device = str(value.device) if isinstance(value, torch.Tensor) else "cpu"
    container = "torch" if isinstance(value, torch.Tensor) else "numpy"
    nbytes = (
        value.numel() * value.element_size() if isinstance(value, torch.Tensor) else value.nbytes
    )
    on_device = is_device_tensor(value) and nbytes > opts.inline_bytes
    # A device tensor stays where it is: its chunks are copied to host buffers batch by batch.
    t = value.detach().contiguous() if on_device else as_cpu_tensor(value, key)
    name = dtype_name(t.dtype, key)
    flat = t.reshape(-1).view(torch.uint8) if on_device else None
    view = memoryview(b"") if on_device else byte_view(t)
    p.keepalive.append(t)
    shape = tuple(t.shape)
    if not on_device and len(view) <= opts.inline_bytes:
        p.entries[key] = TensorEntry(
            name, shape, data=bytes(view), container=container, device=device
        )
        return
    grid, blocks = cuts(shape, t.element_size(), opts.chunk_bytes)
    boxes = []
    for offsets, sizes, start, stop in blocks:
        if flat is not None:
            chunk = Chunk(key, view, t.element_size(), name in GROUPED, source=flat[start:stop])
        else:
            chunk = Chunk(key, view[start:stop], t.element_size(), name in GROUPED)
        p.chunks.append(chunk)
        boxes.append((offsets, sizes, chunk))
    p.boxes[key] = boxes
    p.tensors[key] = (t, container, device)
    p.entries[key] = TensorEntry(name, shape, (), grid.block, container=container, device=device)


def dtypes_of(p: Plan) -> dict[str, str]:
    """Chunked key -> dtype name (what the take's guard measures)."""
    return {
        key: e.dtype
        for key, e in p.entries.items()
        if key in p.boxes and isinstance(e, TensorEntry)
    }


def with_base(p: Plan, base: Manifest | None, opts: TakeOptions) -> None:
    """Give the plan's chunks their candidate bases in ``base`` (when deltas are on)."""
    if base is not None and opts.delta_depth > 0:
        attach_bases(p.boxes, p.entries, base)


def finish_entries(p: Plan) -> dict[str, Entry]:
    """The plan's entries, each chunked tensor's placeholder replaced by one listing its chunk
    ids and checks (every chunk is hashed)."""
    for key, boxes in p.boxes.items():
        e = p.entries[key]
        assert isinstance(e, TensorEntry)
        refs = tuple(ChunkRef(o, s, c.id, c.check or None) for o, s, c in boxes)
        p.entries[key] = TensorEntry(
            e.dtype, e.shape, refs, e.block, container=e.container, device=e.device
        )
    return p.entries
