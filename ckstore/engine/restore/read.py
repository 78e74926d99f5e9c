"""Random access: read one entry, a subtree, or an app's whole state without restoring.

Each read fetches only the chunks of the entries asked for, checking every one (I3).
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from typing import Any

import torch

from ...errors import KeyNotFoundError, MismatchError
from ...format.manifest import Manifest, PerRankEntry
from ...format.tree import ABSENT, join, prune, subtree, tree_refs, unflatten
from .dcp_keys import DCP_APP, app_paths, is_dcp_manifest, nest, recorded_paths
from .reader import Reader, check_destination, is_dtensor_dest


def read_object(reader: Reader, key: str, obj_out: Any = None) -> Any:
    """Read one entry, or a whole subtree (an app_state name or a container path).

    A per-rank entry read outside a distributed restore (``reader.rank`` None) comes back as a
    list with one value per rank of the take. With ``reader.rank`` set, each per-rank entry
    gives that rank's value; in a subtree, those the rank has none of are left out.

    Raises:
        KeyNotFoundError: ``key`` is not in the snapshot, or is a per-rank entry the rank has
            no value for.
    """
    m = reader.manifest
    if key in m.entries:
        if not reader.has_value(key):
            entry = m.entries[key]
            assert isinstance(entry, PerRankEntry)
            raise KeyNotFoundError(
                f"{reader.where}: key {key!r} was stored per rank by {entry.world_size} rank(s); "
                f"rank {reader.rank} has no value"
            )
        keys = [key]
        tree: Any = {"$ref": key}
    else:
        tree = _find_subtree(m, key)
        keys = [k for k in tree_refs(tree) if reader.has_value(k)]
    per_rank = {k for k in keys if reader.rank is None and isinstance(m.entries[k], PerRankEntry)}
    tensor_keys = [k for k in keys if k not in per_rank and reader.is_tensor(k)]
    tensors = reader.read_tensors(tensor_keys)
    if obj_out is not None and key in tensors:
        _copy_into(obj_out, tensors[key], key, reader.where)
        return obj_out
    lists = {k: _per_rank_values(reader, k) for k in per_rank}
    wanted = set(keys)

    def resolve(k: str) -> Any:
        if k not in wanted:
            return ABSENT
        return lists[k] if k in lists else reader.value_of(k, tensors)

    return prune(unflatten(tree, resolve))


def read_state(reader: Reader, app: str) -> Any:
    """The state dict of app_state name ``app`` as the take stored it for ``reader.rank``.

    Per-rank values that rank has none of (the take had fewer ranks) are left out, as
    TorchSnapshot's ``get_state_dict_for_key`` does. For a snapshot written by ``dcp.save``
    (whose only app is ``"dcp"``), ``app`` is a top-level key of the state given to
    ``dcp.save``: the state under it is rebuilt from the paths DCP recorded, as ``dcp.load``
    would fill it (``"dcp"`` itself still gives the flat FQN -> value dict).

    Raises:
        KeyNotFoundError: the snapshot has no app_state name ``app`` (the message lists those
            it has).
    """
    m = reader.manifest
    if app not in m.apps and is_dcp_manifest(m):
        return _dcp_state(reader, app)
    if app not in m.apps:
        raise KeyNotFoundError(
            f"{reader.where} has no app_state key {app!r} (it has {sorted(m.apps)})"
        )
    keys = {k for k in tree_refs(m.apps[app]) if reader.has_value(k)}
    tensors = reader.read_tensors([k for k in sorted(keys) if reader.is_tensor(k)])
    return prune(
        unflatten(m.apps[app], lambda k: reader.value_of(k, tensors) if k in keys else ABSENT)
    )


def _dcp_state(reader: Reader, app: str) -> Any:
    """The state ``dcp.save`` was given under ``app``, rebuilt from the paths it recorded."""
    m = reader.manifest
    paths = app_paths(m, app)
    if not paths:
        apps = sorted({p[0] for p in recorded_paths(m).values()}) or sorted(m.apps)
        raise KeyNotFoundError(
            f"{reader.where} (a dcp.save) has no app_state key {app!r} (it has {apps})"
        )
    keys = {fqn: join(DCP_APP, fqn) for fqn in paths}
    tensors = reader.read_tensors([k for k in keys.values() if reader.is_tensor(k)])
    return nest({paths[fqn]: reader.value_of(key, tensors) for fqn, key in keys.items()})


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
    if is_dtensor_dest(dest):
        raise MismatchError(
            f"{where}: obj_out for key {key!r} is a DTensor; read the global tensor (no obj_out) "
            "and distribute_tensor() it, or restore() into the DTensor to read only its shard"
        )
    if dest.is_meta:
        raise MismatchError(
            f"{where}: obj_out for key {key!r} is on the meta device, which holds no values; "
            "read it without obj_out (a new CPU tensor), or materialise it first"
        )
    check_destination(dest, src.dtype, tuple(src.shape), key, where)
    with torch.no_grad():
        dest.copy_(src)
