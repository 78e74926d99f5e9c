"""Boxes in global tensor coordinates: a DTensor's local region, and grid blocks cut to a box.

A box is ``(offsets, sizes)``. A sharded tensor is written as the chunk grid of its GLOBAL
shape intersected with each rank's box, so a block wholly inside one shard keeps the same
content id whatever the world size; only blocks cut by a shard boundary become rank-specific
pieces.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .grid import Box, Grid


def is_dtensor(value: Any) -> bool:
    """True for a torch.distributed DTensor (checked without importing it eagerly)."""
    import torch

    if type(value) in (torch.Tensor, torch.nn.Parameter) or not callable(
        getattr(value, "to_local", None)
    ):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_box(t: Any) -> Box:
    """The region of the global tensor that this rank's shard of DTensor ``t`` holds.

    Supports Shard(d) and Replicate on meshes of any dimension (uneven and empty shards
    included); several ranks hold the same box where a mesh dimension replicates.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [p for p in t.placements if type(p).__name__ not in ("Shard", "Replicate")]
    if odd:
        raise ValueError(
            f"DTensor placements {odd} are not supported (only Shard(d) and Replicate); "
            "call .redistribute() or .full_tensor() first"
        )
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    sizes = tuple(int(s) for s in shape)
    local = tuple(t.to_local().shape)
    if local != sizes:
        raise ValueError(
            f"DTensor local shard has shape {list(local)}, its placements say {list(sizes)}"
        )
    return tuple(int(o) for o in offsets), sizes


def pieces(grid: Grid, box: Box) -> Iterator[Box]:
    """The grid's blocks intersected with ``box`` (non-empty ones), in C order of the blocks."""
    offs, sizes = box
    if not grid.shape:
        if grid.nbytes:
            yield (), ()
        return
    if any(s == 0 for s in sizes):
        return
    yield from _cut(grid.block, offs, sizes, 0, (), ())


def _cut(
    block: tuple[int, ...],
    offs: tuple[int, ...],
    sizes: tuple[int, ...],
    d: int,
    po: tuple[int, ...],
    ps: tuple[int, ...],
) -> Iterator[Box]:
    if d == len(block):
        yield po, ps
        return
    lo, hi, b = offs[d], offs[d] + sizes[d], block[d]
    start = (lo // b) * b
    while start < hi:
        a, z = max(start, lo), min(start + b, hi)
        yield from _cut(block, offs, sizes, d + 1, po + (a,), ps + (z - a,))
        start += b
