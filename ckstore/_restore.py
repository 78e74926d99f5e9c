"""Restore and random access: rebuild tensors from verified chunks.

``restore`` runs in three phases so a bad snapshot never leaves the caller half-loaded:
validate (keys, dtypes, shapes against the destination), read (every chunk fetched with one
ranged read, decoded and re-hashed; a mismatch raises CorruptionError naming the key), apply
(copy into the destination's own tensors, then ``load_state_dict``). Nothing of the caller's is
touched before the read phase succeeded.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from . import objects
from ._dtypes import dtype_from_name
from ._grid import Grid
from ._tensors import empty_for, from_bytes, writable_view
from ._tree import flatten, subtree, tree_refs, unflatten
from .errors import CorruptionError, KeyNotFoundError, MismatchError
from .manifest import Manifest, TensorEntry, ValueEntry


@dataclass
class Reader:
    """Reads tensor entries of one manifest from the object store, verifying every chunk."""

    objs: objects.ObjectStore
    index: Any
    manifest: Manifest
    where: str
    threads: int = 2

    def read_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Return a new CPU tensor per key, each chunk re-hashed against its id."""
        out: dict[str, torch.Tensor] = {}
        jobs: list[tuple[str, str, memoryview]] = []
        for key in keys:
            entry = self.manifest.entries[key]
            assert isinstance(entry, TensorEntry)
            if entry.inline:
                out[key] = from_bytes(entry.data or b"", entry.dtype, entry.shape)
                continue
            t = empty_for(entry.dtype, entry.shape)
            out[key] = t
            view = writable_view(t)
            grid = Grid(entry.shape, t.element_size(), entry.block or ())
            for c in entry.chunks:
                start, stop = grid.byte_range(c.offsets, c.sizes)
                jobs.append((key, c.id, view[start:stop]))
        self._fetch(jobs)
        return out

    def _fetch(self, jobs: list[tuple[str, str, memoryview]]) -> None:
        locs = self.index.chunk_locations({cid for _, cid, _ in jobs})

        def one(job: tuple[str, str, memoryview]) -> None:
            key, cid, out = job
            rec = locs.get(cid)
            if rec is None:
                raise CorruptionError(
                    f"{self.where}: key {key!r} needs chunk {cid[:16]}… which the index does not "
                    "know; run `ckstore check` (the index may need `ckstore reindex`)"
                )
            loc = objects.ChunkLocation(rec.chunk_id, rec.pack_id, rec.offset, rec.length, rec.raw_length, rec.codec)
            try:
                self.objs.read_chunk(loc, out=out)
            except CorruptionError as exc:
                raise CorruptionError(
                    f"{self.where}: key {key!r} is damaged in storage ({exc}); nothing was "
                    "restored. Run `ckstore check --read-data` and restore an older snapshot"
                ) from exc

        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ckstore-read") as pool:
            for _ in pool.map(one, jobs):
                pass

    def value_of(self, key: str, tensors: Mapping[str, torch.Tensor]) -> Any:
        entry = self.manifest.entries[key]
        if isinstance(entry, ValueEntry):
            return entry.value
        t = tensors[key]
        return t.numpy() if entry.container == "numpy" else t


def read_object(reader: Reader, key: str, obj_out: Any = None) -> Any:
    """Read one entry, or a whole subtree (an app_state name or a container path)."""
    m = reader.manifest
    if key in m.entries:
        keys = [key]
        tree: Any = {"$ref": key}
    else:
        tree = _find_subtree(m, key)
        keys = tree_refs(tree)
    tensor_keys = [k for k in keys if isinstance(m.entries[k], TensorEntry)]
    tensors = reader.read_tensors(tensor_keys)
    if obj_out is not None and key in tensors:
        _copy_into(obj_out, tensors[key], key, reader.where)
        return obj_out
    return unflatten(tree, lambda k: reader.value_of(k, tensors))


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


def restore(reader: Reader, app_state: Mapping[str, Any], strict: bool = True) -> None:
    """Load the snapshot into ``app_state`` in place (see module docstring for the phases)."""
    plans = [_validate(reader, name, obj, strict) for name, obj in app_state.items()]
    plans = [p for p in plans if p is not None]
    tensor_keys = [k for p in plans for k in p.keys if isinstance(reader.manifest.entries[k], TensorEntry)]
    tensors = reader.read_tensors(tensor_keys)
    for p in plans:
        _apply(reader, p, tensors)


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
        entry = m.entries[key]
        dest = current.get(key)
        if isinstance(entry, TensorEntry) and isinstance(dest, torch.Tensor):
            _check_tensor(dest, dtype_from_name(entry.dtype), entry.shape, key, reader.where)
            plan.dest[key] = dest
    if strict:
        _check_keys(reader, plan, current, isinstance(obj, torch.nn.Module))
    return plan


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
        for key, dest in plan.dest.items():
            dest.copy_(tensors[key])

    def resolve(key: str) -> Any:
        return plan.dest[key] if key in plan.dest else reader.value_of(key, tensors)

    state = unflatten(reader.manifest.apps[plan.name], resolve)
    if isinstance(plan.obj, torch.nn.Module):
        plan.obj.load_state_dict(state, strict=False)
    else:
        plan.obj.load_state_dict(state)
