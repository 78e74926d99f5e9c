"""A snapshot written by ``dcp.save`` seen through ckstore's own ``restore``.

``ckstore.dcp.StorageWriter`` stores each DCP key (an FQN such as ``model.0.weight``) as the
manifest entry ``dcp/<fqn>`` (app ``"dcp"``). ``snap.restore(app_state)`` maps an app_state
onto those keys the way ``dcp.save(app_state_dicts)`` names them: the FQN of a leaf is the
path from the app_state name down, joined by ``"."``, where (as in DCP's
``flatten_state_dict``) dicts are always walked into (keys as ``str``), lists are walked into
only when something inside is a tensor or a dict, and anything else (a tuple, a list of plain
values such as an optimizer's ``param_groups``) is one value. So ``{"model": m}`` reads
``dcp/model.0.weight`` into ``m``'s ``0.weight``, and ``{"optim": o}`` reads
``dcp/optim.state.0.exp_avg`` and ``dcp/optim.param_groups``.

:func:`dcp_overlay` builds a manifest with the destination's own structure (its key types
included: an optimizer's int state keys stay ints) whose entries are the stored DCP entries,
so everything else (validation, verified reads, DTensor resharding, distributed restore) is
the ordinary restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import MismatchError, UnsupportedValueError
from ...format.manifest import Entry, Manifest
from ...format.tree import join
from ...format.values import decode_value, dict_class_name, encode_value, is_plain

DCP_APP = "dcp"


def is_dcp_manifest(manifest: Manifest) -> bool:
    """True for a snapshot written by ``dcp.save`` into ckstore."""
    return (
        isinstance(manifest.snapshot, dict)
        and "dcp" in manifest.snapshot
        and DCP_APP in manifest.apps
    )


def dcp_overlay(manifest: Manifest, app_state: Mapping[str, Any], strict: bool) -> Manifest:
    """``manifest`` (a DCP save) re-keyed for ``app_state`` (see the module docstring).

    Destination leaves with no stored FQN are left out of the state loaded; non-strict, an app
    none of whose FQNs is stored is not loaded at all.

    Raises:
        MismatchError: strict, and a destination tensor has no stored FQN, or a module's
            stored FQNs include some the module does not have.
    """
    apps: dict[str, Any] = {}
    entries: dict[str, Entry] = {}
    where = "DCP snapshot"
    for name, obj in app_state.items():
        fqns: dict[str, tuple[str, Any]] = {}
        tree = _walk(name, (name,), obj.state_dict(), fqns)
        found = {key: f for key, (f, _) in fqns.items() if join(DCP_APP, f) in manifest.entries}
        if not found and not strict:
            continue
        missing = sorted(
            k for k, (_, v) in fqns.items() if k not in found and isinstance(v, torch.Tensor)
        )
        if strict and (missing or not found):
            missing = missing or sorted(fqns)
            raise MismatchError(
                f"{where} does not match app_state[{name!r}]: no DCP key for {missing[:5]} (looked up "
                f"as {[fqns[k][0] for k in missing[:5]]}); pass strict=False to load what matches"
            )
        if strict and isinstance(obj, torch.nn.Module):
            _check_unexpected(manifest, name, set(found.values()))
        apps[name] = _keep(tree, set(found))
        for key, f in found.items():
            entries[key] = manifest.entries[join(DCP_APP, f)]
    return Manifest(apps, entries, manifest.snapshot)


def _walk(key: str, path: tuple[Any, ...], obj: Any, fqns: dict[str, tuple[str, Any]]) -> Any:
    """The ckstore tree of ``obj`` with DCP's leaves; records key -> (FQN, current value)."""
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not is_plain(k) or isinstance(k, (bytes, bytearray)):
                continue
            items.append([encode_value(k, key), _walk(join(key, str(k)), (*path, str(k)), v, fqns)])
        node: dict[str, Any] = {
            "$dict": items,
            "$cls": dict_class_name(obj) if isinstance(obj, dict) else "dict",
        }
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, dict):
            try:
                node["$meta"] = encode_value(meta, key)
            except UnsupportedValueError:
                pass
        return node
    if isinstance(obj, list) and not _terminal(obj):
        return [_walk(join(key, str(i)), (*path, i), v, fqns) for i, v in enumerate(obj)]
    fqns[key] = (".".join(map(str, path)), obj)
    return {"$ref": key}


def _terminal(value: Any) -> bool:
    """DCP's rule: a list is one value unless a tensor or a dict lies inside it."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return all(
        not isinstance(v, torch.Tensor) and (not isinstance(v, (Mapping, list)) or _terminal(v))
        for v in value
    )


def _keep(tree: Any, keys: set[str]) -> Any:
    """``tree`` without leaves outside ``keys`` (and without containers left empty by that)."""
    if isinstance(tree, list):
        return [c for c in (_keep(t, keys) for t in tree) if c is not None]
    if "$ref" in tree:
        return tree if tree["$ref"] in keys else None
    if "$dict" in tree:
        kept = [[k, c] for k, c in ((k, _keep(v, keys)) for k, v in tree["$dict"]) if c is not None]
        return {**tree, "$dict": kept}
    return tree


def _check_unexpected(manifest: Manifest, name: str, matched: set[str]) -> None:
    prefix = join(DCP_APP, name) + "."
    known = {join(DCP_APP, f) for f in matched}
    extra = sorted(
        k[len(DCP_APP) + 1 :] for k in manifest.entries if k.startswith(prefix) and k not in known
    )
    if extra:
        raise MismatchError(
            f"DCP snapshot does not match app_state[{name!r}]: stored keys {extra[:5]} are not in "
            "the module; pass strict=False to load what matches"
        )


def recorded_paths(manifest: Manifest) -> dict[str, tuple[Any, ...]]:
    """Each stored DCP key -> where it sat in the state given to ``dcp.save``.

    ``dcp.save({"model": sd, "step": 3})`` records it as DCP's ``planner_data``
    (``"model.0.weight" -> ("model", "0.weight")``). Keys without a stored entry, and paths
    that are not str keys and int positions, are left out; empty when the save recorded no
    paths (a planner without ``planner_data``).
    """
    header = manifest.snapshot or {}
    doc = header.get("dcp")
    try:
        mapping = decode_value(doc.get("planner_data")) if isinstance(doc, dict) else None
    except (TypeError, ValueError):
        return {}
    if not isinstance(mapping, dict):
        return {}
    return {
        fqn: path
        for fqn, path in mapping.items()
        if isinstance(fqn, str)
        and isinstance(path, tuple)
        and path
        and isinstance(path[0], str)
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
        and join(DCP_APP, fqn) in manifest.entries
    }


def app_paths(manifest: Manifest, app: str) -> dict[str, tuple[Any, ...]]:
    """The stored DCP keys of app_state name ``app`` -> their path below it (``()`` for the
    value given as ``app`` itself); see :func:`recorded_paths`."""
    return {fqn: path[1:] for fqn, path in recorded_paths(manifest).items() if path[0] == app}


def nest(values: dict[tuple[Any, ...], Any]) -> Any:
    """The object whose leaves at ``path`` are ``values[path]`` (str parts: dict keys; int
    parts: list positions, gaps filled with None); ``values[()]``, if given, is the object."""
    if () in values:
        return values[()]
    root: dict[Any, Any] = {}
    for path, value in sorted(
        values.items(), key=lambda kv: [(isinstance(p, str), p) for p in kv[0]]
    ):
        node: Any = root
        for here, nxt in zip(path, path[1:]):
            fresh: Any = [] if isinstance(nxt, int) else {}
            node = _child(node, here, fresh)
        _set(node, path[-1], value)
    return root


def _child(node: Any, key: Any, fresh: Any) -> Any:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
        if node[key] is None:
            node[key] = fresh
        return node[key]
    return node.setdefault(key, fresh)


def _set(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
    node[key] = value
