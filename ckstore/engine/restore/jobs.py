"""Chunk jobs: which stored chunks fill which part of a destination tensor, and where each
one's bytes go (straight into a contiguous CPU tensor, or through a host buffer into any
other). Pure bookkeeping in global tensor coordinates; the passes that run jobs are the
:class:`~ckstore.engine.restore.fetch.Fetcher`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import objects
from ...format.dtypes import dtype_from_name
from ...format.manifest import TensorEntry
from ...format.tensors import writable_view
from .. import devices

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


@dataclass
class Job:
    """One chunk to fetch: decoded straight into ``out``, or into a host buffer copied to ``dst``."""

    key: str
    cid: str
    out: memoryview | None = None
    check: str | None = None
    """The chunk's check from the manifest (``objects.raw_check``); None: verify by id."""
    dtype: str = ""
    sizes: tuple[int, ...] = ()
    src: tuple[slice, ...] = ()
    dst: torch.Tensor | None = None
    loc: objects.ChunkLocation | None = None


def raw_bytes(job: Job) -> int:
    """The raw bytes of ``job``'s chunk."""
    if job.loc is not None:
        return job.loc.raw_length
    if job.out is not None:  # the chunk's place in its destination
        return len(job.out)
    return math.prod(job.sizes) * dtype_from_name(job.dtype).itemsize


def plan_jobs(
    key: str, entry: TensorEntry, t: torch.Tensor, offs: tuple[int, ...], sizes: tuple[int, ...]
) -> list[Job]:
    """Jobs filling ``t`` (the region ``offs``/``sizes`` of ``key``) from the chunks overlapping it.

    A chunk lying wholly inside the region and contiguous there, in a contiguous CPU tensor,
    is decoded straight into place; any other is decoded into a host buffer and its overlap
    copied in.
    """
    view = direct_view(t)
    strides = _strides(sizes)
    jobs = []
    for c in entry.chunks:
        inter = intersect(c.offsets, c.sizes, offs, sizes)
        if inter is None:
            continue
        if view is not None and inter == (c.offsets, c.sizes) and _contiguous(c.sizes, sizes):
            start = sum((o - r) * s for o, r, s in zip(c.offsets, offs, strides)) * t.element_size()
            end = start + math.prod(c.sizes) * t.element_size()
            jobs.append(Job(key, c.id, view[start:end], check=c.check))
        else:
            io, isz = inter
            jobs.append(
                Job(
                    key,
                    c.id,
                    None,
                    c.check,
                    entry.dtype,
                    c.sizes,
                    slices(io, c.offsets, isz),
                    t[slices(io, offs, isz)],
                )
            )
    return jobs


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct_view(t: torch.Tensor) -> memoryview | None:
    """The bytes of ``t`` to decode into directly, where they are its values in order (a
    contiguous CPU tensor, no conjugate or negative view, no subclass: a wrapper subclass's
    values are not its storage's bytes); else None (``copy_`` into it)."""
    direct = (
        type(t) in _PLAIN
        and t.device.type == "cpu"
        and t.device.type not in devices.DEVICE_TYPES
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())  # its raw bytes are not its values
    )
    return writable_view(t) if direct else None


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def intersect(
    ao: tuple[int, ...], asz: tuple[int, ...], bo: tuple[int, ...], bsz: tuple[int, ...]
) -> Region | None:
    """The overlap of two boxes, or None when it is empty."""
    lo = tuple(max(a, b) for a, b in zip(ao, bo))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(ao, asz, bo, bsz))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _contiguous(sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """True if a box of ``sizes`` is one contiguous byte range of a C-order tensor of ``shape``."""
    d = 0
    while d < len(sizes) and sizes[d] == 1:
        d += 1
    return all(s == n for s, n in zip(sizes[d + 1 :], shape[d + 1 :]))


def slices(
    offsets: tuple[int, ...], origin: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[slice, ...]:
    """Index of the box (offsets, sizes) inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - r, o - r + n) for o, r, n in zip(offsets, origin, sizes))
