"""Restore and random access: rebuild tensors from verified chunks.

``restore`` runs in three phases so a bad snapshot never leaves the caller half-loaded:
validate (keys, dtypes, shapes against the destination), read (every chunk fetched with one
ranged read, decoded and re-hashed; a mismatch raises CorruptionError naming the key), apply
(copy into the destination's own tensors, then ``load_state_dict``). Nothing of the caller's is
touched before the read phase succeeded.
"""

from __future__ import annotations

import difflib
import math
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import objects
from ..errors import CorruptionError, InvalidInputError, KeyNotFoundError, MismatchError
from ..format.dtypes import dtype_from_name
from ..format.manifest import Entry, Manifest, PerRankEntry, TensorEntry, ValueEntry
from ..format.tensors import empty_for, from_bytes, writable_view
from ..format.tree import flatten, subtree, tree_refs, unflatten
from .locations import to_location

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


@dataclass
class _Job:
    """One chunk to fetch: decoded straight into ``out``, or into a temporary then copied."""

    key: str
    cid: str
    out: memoryview | None = None
    dtype: str = ""
    sizes: tuple[int, ...] = ()
    src: tuple[slice, ...] = ()
    dst: torch.Tensor | None = None


@dataclass
class Reader:
    """Reads tensor entries of one manifest from the object store, verifying every chunk.

    ``rank`` is the caller's rank in a distributed restore: it picks each per-rank entry's own
    value (a process that is not distributed counts as rank 0).
    """

    objs: objects.ObjectStore
    index: Any
    manifest: Manifest
    where: str
    threads: int = 2
    rank: int | None = None

    def entry(self, key: str) -> Entry:
        """The entry of ``key`` for this reader's rank (per-rank entries resolved)."""
        entry = self.manifest.entries[key]
        if isinstance(entry, PerRankEntry):
            rank = self.rank or 0
            if rank >= entry.world_size:
                raise MismatchError(
                    f"{self.where}: key {key!r} was stored per rank by a take with "
                    f"{entry.world_size} rank(s) (its value differed between ranks); rank {rank} "
                    "has no value to restore. Restore with at most that many ranks, or leave its "
                    "app_state name out of the restore (strict=False)"
                )
            return entry.entries[rank]
        return entry

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.entry(key), TensorEntry)

    def read_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Return a new CPU tensor per key, each chunk re-hashed against its id."""
        return self.read_regions({k: None for k in keys})

    def read_regions(self, wanted: Mapping[str, Region | None]) -> dict[str, torch.Tensor]:
        """Return, per key, a new CPU tensor holding the region asked for (None: all of it).

        Only chunks overlapping a region are fetched. A chunk lying wholly inside its region
        and contiguous there is decoded straight into place; any other (a chunk cut by the
        region, or a shard piece that is not contiguous in C order) is decoded into a
        temporary and its overlap copied in.
        """
        out: dict[str, torch.Tensor] = {}
        targets: dict[str, tuple[torch.Tensor, Region | None]] = {}
        for key, region in wanted.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            sizes = region[1] if region is not None else entry.shape
            out[key] = empty_for(entry.dtype, sizes)
            targets[key] = (out[key], region)
        self.read_into(targets)
        return out

    def read_into(self, targets: Mapping[str, tuple[torch.Tensor, Region | None]]) -> None:
        """Decode each key's region (None: all of it) into the given tensor, verifying chunks.

        The tensor must have the region's shape and the entry's dtype; it may live on any
        device and have any strides (contiguous CPU tensors are decoded into directly).
        """
        jobs: list[_Job] = []
        for key, (t, region) in targets.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            offs, sizes = region if region is not None else ((0,) * len(entry.shape), entry.shape)
            if t.numel() == 0:
                continue
            if entry.inline:
                with torch.no_grad():
                    t.copy_(from_bytes(entry.data or b"", entry.dtype, entry.shape)[_slices(offs, offs, sizes)])
                continue
            jobs.extend(self._jobs(key, entry, t, offs, sizes))
        self._fetch(jobs)

    def verify(self, wanted: Mapping[str, Region | None]) -> None:
        """Fetch, decode and re-hash every chunk overlapping the regions; keep nothing."""
        jobs: list[_Job] = []
        for key, region in wanted.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            offs, sizes = region if region is not None else ((0,) * len(entry.shape), entry.shape)
            jobs.extend(_Job(key, c.id) for c in entry.chunks if _intersect(c.offsets, c.sizes, offs, sizes))
        self._fetch(jobs)

    def _jobs(self, key: str, entry: TensorEntry, t: torch.Tensor, offs: tuple[int, ...], sizes: tuple[int, ...]) -> list[_Job]:
        direct = t.device.type == "cpu" and t.is_contiguous()
        view = writable_view(t) if direct else None
        strides = _strides(sizes)
        jobs = []
        for c in entry.chunks:
            inter = _intersect(c.offsets, c.sizes, offs, sizes)
            if inter is None:
                continue
            if view is not None and inter == (c.offsets, c.sizes) and _contiguous(c.sizes, sizes):
                start = sum((o - r) * s for o, r, s in zip(c.offsets, offs, strides)) * t.element_size()
                jobs.append(_Job(key, c.id, view[start : start + math.prod(c.sizes) * t.element_size()]))
            else:
                io, isz = inter
                jobs.append(_Job(key, c.id, None, entry.dtype, c.sizes, _slices(io, c.offsets, isz), t[_slices(io, offs, isz)]))
        return jobs

    def _fetch(self, jobs: list[_Job]) -> None:
        locs = self.index.chunk_locations({j.cid for j in jobs})

        def one(job: _Job) -> None:
            rec = locs.get(job.cid)
            if rec is None:
                raise CorruptionError(
                    f"{self.where}: key {job.key!r} needs chunk {job.cid[:16]}… which the index does not "
                    "know; run `ckstore check` (the index may need `ckstore reindex`)"
                )
            loc = to_location(rec)
            tmp = empty_for(job.dtype, job.sizes) if job.out is None and job.dst is not None else None
            if tmp is not None:
                out = writable_view(tmp)
            else:  # a verify-only job decodes into this thread's scratch buffer
                out = job.out if job.out is not None else _scratch(loc.raw_length)
            try:
                self.objs.read_chunk(loc, out=out)
            except CorruptionError as exc:
                raise CorruptionError(
                    f"{self.where}: key {job.key!r} is damaged in storage ({exc}); nothing was "
                    "restored. Run `ckstore check --read-data` and restore an older snapshot"
                ) from exc
            if tmp is not None and job.dst is not None:
                with torch.no_grad():
                    job.dst.copy_(tmp[job.src])

        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ckstore-read") as pool:
            for _ in pool.map(one, jobs):
                pass

    def value_of(self, key: str, tensors: Mapping[str, torch.Tensor]) -> Any:
        entry = self.entry(key)
        if isinstance(entry, ValueEntry):
            return entry.value
        t = tensors[key]
        return t.numpy() if entry.container == "numpy" else t  # type: ignore[union-attr]


_local = threading.local()


def _scratch(n: int) -> memoryview:
    """This thread's reusable buffer of ``n`` bytes: verifying a chunk allocates nothing (a
    fresh buffer per chunk costs page faults that halved the verify pass's speed)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(n)
    return memoryview(buf)[:n]


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def _intersect(ao: tuple[int, ...], asz: tuple[int, ...], bo: tuple[int, ...], bsz: tuple[int, ...]) -> Region | None:
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


def _slices(offsets: tuple[int, ...], origin: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the box (offsets, sizes) inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - r, o - r + n) for o, r, n in zip(offsets, origin, sizes))


def read_object(reader: Reader, key: str, obj_out: Any = None) -> Any:
    """Read one entry, or a whole subtree (an app_state name or a container path).

    A per-rank entry read outside a distributed restore (``reader.rank`` None) comes back as a
    list with one value per rank of the take.
    """
    m = reader.manifest
    if key in m.entries:
        keys = [key]
        tree: Any = {"$ref": key}
    else:
        tree = _find_subtree(m, key)
        keys = tree_refs(tree)
    per_rank = {k for k in keys if reader.rank is None and isinstance(m.entries[k], PerRankEntry)}
    tensor_keys = [k for k in keys if k not in per_rank and reader.is_tensor(k)]
    tensors = reader.read_tensors(tensor_keys)
    if obj_out is not None and key in tensors:
        _copy_into(obj_out, tensors[key], key, reader.where)
        return obj_out
    lists = {k: _per_rank_values(reader, k) for k in per_rank}
    return unflatten(tree, lambda k: lists[k] if k in lists else reader.value_of(k, tensors))


def _per_rank_values(reader: Reader, key: str) -> list[Any]:
    entry = reader.manifest.entries[key]
    assert isinstance(entry, PerRankEntry)
    out = []
    for r in range(entry.world_size):
        sub = replace(reader, rank=r)
        tensors = sub.read_tensors([key] if sub.is_tensor(key) else [])
        out.append(sub.value_of(key, tensors))
    return out


def _find_subtree(m: Manifest, key: str) -> Any:
    app = key.split("/", 1)[0]
    node = subtree(m.apps[app], app, key) if app in m.apps else None
    if node is None:
        near = difflib.get_close_matches(key, list(m.entries) + list(m.apps), n=3)
        hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        raise KeyNotFoundError(f"key {key!r} is not in the snapshot{hint} (see get_manifest())")
    return node


def _copy_into(dest: Any, src: torch.Tensor, key: str, where: str) -> None:
    if not isinstance(dest, torch.Tensor):
        raise MismatchError(f"{where}: obj_out for key {key!r} must be a tensor")
    _check_tensor(dest, src.dtype, tuple(src.shape), key, where)
    with torch.no_grad():
        dest.copy_(src)


def _check_tensor(dest: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], key: str, where: str) -> None:
    if dest.dtype != dtype or tuple(dest.shape) != shape:
        raise MismatchError(
            f"{where}: key {key!r} is {dtype} {list(shape)} in the snapshot but "
            f"{dest.dtype} {list(dest.shape)} in the destination; build the destination with "
            "the same shapes/dtypes, or read it with read_object() and convert"
        )


@dataclass
class _AppPlan:
    name: str
    obj: Any
    keys: list[str]
    dest: dict[str, torch.Tensor] = field(default_factory=dict)
    target: dict[str, torch.Tensor] = field(default_factory=dict)  # where the bytes go (a DTensor's local shard)
    region: dict[str, Region] = field(default_factory=dict)  # the part of the global tensor needed


@dataclass
class Prepared:
    """A validated and verified restore, not yet applied to the destination.

    ``tensors`` holds what was read (new tensors, and staged copies for destinations); keys in
    ``direct`` were verified but not kept, and are decoded straight into the destination by
    :func:`apply` (a second, again verified, read) because staging them would exceed the budget.
    """

    plans: list[_AppPlan]
    tensors: dict[str, torch.Tensor]
    direct: dict[str, tuple[torch.Tensor, Region | None]] = field(default_factory=dict)
    verified: bool = True


def restore(
    reader: Reader, app_state: Mapping[str, Any], strict: bool = True, budget: int | None = None, atomic: bool = True
) -> None:
    """Load the snapshot into ``app_state`` in place (see module docstring for the phases)."""
    apply(prepare(reader, app_state, strict, budget, atomic=atomic), reader)


def prepare(
    reader: Reader,
    app_state: Mapping[str, Any],
    strict: bool = True,
    budget: int | None = None,
    plans: list[_AppPlan] | None = None,
    skip: frozenset[str] = frozenset(),
    *,
    atomic: bool = True,
) -> Prepared:
    """Validate and verify everything a restore needs; the destination is not touched.

    Destination tensors whose total size fits ``budget`` bytes are staged (one read). Past the
    budget, every chunk is fetched and re-hashed once here without being kept, and decoded
    straight into the destination by :func:`apply`: memory stays bounded and a damaged chunk is
    still found before anything of the caller's changes.

    ``atomic=False`` skips both the staging and that first pass: :func:`apply` decodes every
    destination tensor straight into place, still re-hashing each chunk, in one pass and with
    no staging memory; a damaged chunk then raises with the destination partly loaded.

    ``plans`` (from :func:`validate`) skips validating again; keys in ``skip`` are not read
    (the caller puts their tensors into ``Prepared.tensors`` before :func:`apply`).
    """
    if plans is None:
        plans = validate(reader, app_state, strict)
    wanted: dict[str, Region | None] = {}
    direct: dict[str, tuple[torch.Tensor, Region | None]] = {}
    for p in plans:
        for k in p.keys:
            if k not in skip and reader.is_tensor(k):
                wanted[k] = p.region.get(k)
                if k in p.target:
                    direct[k] = (p.target[k], p.region.get(k))
    staged = sum(t.numel() * t.element_size() for t, _ in direct.values())
    if atomic and (budget is None or staged <= budget):
        return Prepared(plans, reader.read_regions(wanted))
    if atomic:
        reader.verify({k: wanted[k] for k in direct})
    rest = {k: r for k, r in wanted.items() if k not in direct}
    return Prepared(plans, reader.read_regions(rest), direct, verified=atomic)


def validate(reader: Reader, app_state: Mapping[str, Any], strict: bool = True) -> list[_AppPlan]:
    """Check keys, dtypes and shapes against the destination; read nothing.

    Raises:
        InvalidInputError: ``app_state`` is not a mapping of names to stateful objects.
        MismatchError: keys, dtypes or shapes differ.
    """
    check_app_state(app_state)
    if reader.rank is None:
        reader.rank = 0
    plans = [_validate(reader, name, obj, strict) for name, obj in app_state.items()]
    return [p for p in plans if p is not None]


def check_app_state(app_state: Any) -> None:
    """Refuse an ``app_state`` that is not a mapping of str names (before anything is read).

    Raises:
        InvalidInputError: naming what was passed instead.
    """
    if not isinstance(app_state, Mapping):
        raise InvalidInputError(
            f"app_state must be a dict mapping names to stateful objects (with state_dict() and "
            f"load_state_dict()), got a {type(app_state).__name__}"
        )
    for name in app_state:
        if not isinstance(name, str):
            raise InvalidInputError(f"app_state key {name!r} must be a str")


def whole_plain_keys(reader: Reader, plans: list[_AppPlan]) -> list[str]:
    """Keys whose destination here is a plain tensor needing the whole stored tensor.

    Only entries equal on every rank (not per-rank) and kept in packs (not inline) count: these
    are the ones a distributed restore may read once and broadcast.
    """
    out = []
    for p in plans:
        for k in p.target:
            entry = reader.manifest.entries[k]
            if k not in p.region and isinstance(entry, TensorEntry) and not entry.inline and entry.chunks:
                out.append(k)
    return out


def apply(prepared: Prepared, reader: Reader) -> None:
    """Write what :func:`prepare` verified into the destination and call ``load_state_dict``."""
    try:
        reader.read_into(prepared.direct)
    except CorruptionError as exc:  # atomic: the bytes changed since they were verified moments ago
        why = "the chunk changed after it was verified" if prepared.verified else "restore(atomic=False) loads as it reads"
        raise CorruptionError(f"{exc} (the destination may be partly loaded: {why})") from exc
    for p in prepared.plans:
        _apply(reader, p, prepared.tensors)


def _validate(reader: Reader, name: str, obj: Any, strict: bool) -> _AppPlan | None:
    m = reader.manifest
    if name not in m.apps:
        if not strict:
            return None
        raise MismatchError(
            f"{reader.where} has no app_state key {name!r} (it has {sorted(m.apps)}); "
            "pass strict=False to restore the others"
        )
    if not callable(getattr(obj, "load_state_dict", None)):
        raise MismatchError(f"app_state[{name!r}] has no load_state_dict()")
    keys = tree_refs(m.apps[name])
    current = flatten(name, obj.state_dict(), lenient=True).leaves
    plan = _AppPlan(name, obj, keys)
    for key in keys:
        dest = current.get(key)
        if not isinstance(dest, torch.Tensor):
            continue
        entry = reader.entry(key)
        if not isinstance(entry, TensorEntry):
            continue
        _check_tensor(dest, dtype_from_name(entry.dtype), entry.shape, key, reader.where)
        plan.dest[key] = dest
        plan.target[key] = dest
        if _is_dtensor(dest):
            from ..format.boxes import local_box

            plan.target[key] = dest.to_local()  # type: ignore[attr-defined]
            plan.region[key] = local_box(dest)
    if strict:
        _check_keys(reader, plan, current, isinstance(obj, torch.nn.Module))
    return plan


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and callable(getattr(t, "to_local", None))


def _check_keys(reader: Reader, plan: _AppPlan, current: dict[str, Any], module: bool) -> None:
    stored = set(plan.keys)
    missing = sorted(k for k, v in current.items() if isinstance(v, torch.Tensor) and k not in stored)
    unexpected = sorted(stored - set(current)) if module else []
    if missing or unexpected:
        raise MismatchError(
            f"{reader.where} does not match app_state[{plan.name!r}]: missing from the snapshot "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, not in the destination "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; pass strict=False to load "
            "what matches"
        )


def _apply(reader: Reader, plan: _AppPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, target in plan.target.items():
            if key in tensors:  # else it was decoded in place already
                target.copy_(tensors[key])

    def resolve(key: str) -> Any:
        return plan.dest[key] if key in plan.dest else reader.value_of(key, tensors)

    state = unflatten(reader.manifest.apps[plan.name], resolve)
    if isinstance(plan.obj, torch.nn.Module):
        plan.obj.load_state_dict(state, strict=False)
    else:
        plan.obj.load_state_dict(state)
