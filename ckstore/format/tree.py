"""Flatten a state dict into a JSON tree of containers plus addressable leaves, and back.

Keys are '/'-joined paths from the app_state name down (``model/layer.0.weight``,
``optim/state/0/exp_avg``); '%' and '/' inside a part are escaped as ``%25`` and ``%2F``.
Leaves are tensors, NumPy arrays, plain scalars, and lists/tuples made only of plain scalars
(kept whole so a long ``params`` list is one entry, not thousands). Containers (dicts, lists,
tuples with a tensor somewhere below) stay in the tree, which records their types, key types
and order, so restore rebuilds exactly the structure ``state_dict()`` produced.

Walking a stored tree (``unflatten``, ``tree_refs``, ``subtree``) needs no torch or NumPy;
only flattening live state does, and imports them then.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptionError, InvalidInputError, UnsupportedValueError
from .limits import MAX_DEPTH
from .values import DICT_CLASSES, decode_value, dict_class_name, encode_value, is_plain


def escape(part: str) -> str:
    """Escape one path part so '/' stays the only separator."""
    return part.replace("%", "%25").replace("/", "%2F")


def join(prefix: str, part: str) -> str:
    """Join an escaped part onto a key prefix."""
    return f"{prefix}/{escape(part)}" if prefix else escape(part)


def is_array(value: Any) -> bool:
    """True for values stored as tensor entries (not a NumPy masked array: its mask would be
    lost, so it is refused as a value)."""
    import numpy as np
    import torch

    return isinstance(value, torch.Tensor) or (
        isinstance(value, np.ndarray) and not isinstance(value, np.ma.MaskedArray)
    )


def _is_plain_seq(value: Any) -> bool:
    import torch

    return (
        isinstance(value, (list, tuple))
        and not isinstance(value, torch.Size)
        and all(is_plain(v) or (isinstance(v, torch.Size)) for v in value)
    )


@dataclass
class Flat:
    """A flattened state: the container tree and the leaves it references, in order."""

    tree: Any
    leaves: dict[str, Any] = field(default_factory=dict)


def flatten(prefix: str, obj: Any, *, lenient: bool = False) -> Flat:
    """Flatten ``obj`` (usually a ``state_dict()``) under key ``prefix``.

    Args:
        prefix: the key of ``obj`` itself (the app_state name).
        obj: the value to flatten.
        lenient: keep values ckstore cannot store as opaque leaves instead of raising (used to
            read a destination's current state, which is never written).

    Raises:
        UnsupportedValueError: a value (or dict key) has a type ckstore does not store.
        InvalidInputError: two keys of one dict map to the same path (e.g. ``1`` and ``"1"``),
            or containers are nested deeper than ``MAX_DEPTH`` (also when ``lenient``).
    """
    flat = Flat(tree=None)
    flat.tree = _flatten(prefix, obj, flat.leaves, lenient, 0)
    return flat


def _flatten(key: str, obj: Any, leaves: dict[str, Any], lenient: bool, depth: int) -> Any:
    import torch

    if is_array(obj) or is_plain(obj) or isinstance(obj, torch.Size) or _is_plain_seq(obj):
        leaves[key] = obj
        return {"$ref": key}
    if isinstance(obj, (dict, list, tuple)) and depth >= MAX_DEPTH:
        raise InvalidInputError(
            f"key {key!r}: containers nested deeper than {MAX_DEPTH} levels; a state_dict() "
            "this deep is refused (see the limits in docs/FORMAT.md)"
        )
    if isinstance(obj, dict):
        return _flatten_dict(key, obj, leaves, lenient, depth)
    if isinstance(obj, (list, tuple)):
        children = [
            _flatten(join(key, str(i)), v, leaves, lenient, depth + 1) for i, v in enumerate(obj)
        ]
        return children if isinstance(obj, list) else {"$tuple": children}
    if lenient:
        leaves[key] = obj
        return {"$ref": key}
    encode_value(obj, key)  # raises the typed error naming the key
    raise UnsupportedValueError(f"key {key!r}: unsupported value")  # pragma: no cover


def _flatten_dict(
    key: str, obj: dict[Any, Any], leaves: dict[str, Any], lenient: bool, depth: int
) -> Any:
    items = []
    seen: dict[str, Any] = {}
    for k, v in obj.items():
        if not is_plain(k) or isinstance(k, (bytes, bytearray, io.BytesIO)):
            if lenient:
                continue
            raise UnsupportedValueError(
                f"key {key!r}: dict key {k!r} of type {type(k).__name__} is not supported; "
                "use str or int keys"
            )
        path = join(key, str(k))
        if path in seen:
            raise InvalidInputError(
                f"key {key!r}: dict keys {seen[path]!r} and {k!r} both map to {path!r}; "
                "rename one of them"
            )
        seen[path] = k
        items.append([encode_value(k, key), _flatten(path, v, leaves, lenient, depth + 1)])
    node: dict[str, Any] = {
        "$dict": items,
        "$cls": dict_class_name(obj),
    }
    meta = getattr(obj, "_metadata", None)
    if isinstance(meta, dict) and not lenient:
        node["$meta"] = encode_value(meta, key)
    return node


def unflatten(tree: Any, resolve: Callable[[str], Any], depth: int = 0) -> Any:
    """Rebuild the structure recorded in ``tree``, asking ``resolve(key)`` for each leaf.

    Raises:
        CorruptionError: a node is malformed, or containers are nested deeper than
            ``MAX_DEPTH`` (no writer produces that).
    """
    if isinstance(tree, dict) and "$ref" in tree:
        return resolve(str(tree["$ref"]))
    if depth >= MAX_DEPTH:
        raise CorruptionError(f"manifest tree is nested deeper than {MAX_DEPTH} levels")
    if isinstance(tree, list):
        return [unflatten(t, resolve, depth + 1) for t in tree]
    if not isinstance(tree, dict):
        raise CorruptionError(f"manifest tree holds unexpected JSON {str(tree)[:100]}")
    if "$tuple" in tree and type(tree["$tuple"]) is list:
        return tuple(unflatten(t, resolve, depth + 1) for t in tree["$tuple"])
    if "$dict" in tree and type(tree["$dict"]) is list:
        cls = DICT_CLASSES.get(tree.get("$cls"), dict)
        out: dict[Any, Any] = cls()
        for pair in tree["$dict"]:
            if type(pair) is not list or len(pair) != 2:
                raise CorruptionError(
                    f"manifest tree holds a malformed dict item {str(pair)[:100]}"
                )
            key = decode_value(pair[0])
            if not is_plain(key):
                raise CorruptionError(f"manifest tree holds a dict key {str(pair[0])[:100]}")
            out[key] = unflatten(pair[1], resolve, depth + 1)
        if "$meta" in tree:
            if type(out) is dict:  # a dict subclass carried it: a plain dict cannot
                out = OrderedDict(out)
            out._metadata = decode_value(tree["$meta"])  # type: ignore[attr-defined]
        return out
    raise CorruptionError(f"manifest tree holds an unknown node {str(tree)[:100]}")


def tree_refs(tree: Any) -> list[str]:
    """All leaf keys referenced by ``tree``, in order."""
    out: list[str] = []
    unflatten(tree, lambda k: out.append(k))
    return out


def subtree(tree: Any, prefix: str, key: str) -> Any | None:
    """Return the node of ``tree`` (rooted at ``prefix``) whose path is ``key``, or None."""
    if key == prefix:
        return tree
    if isinstance(tree, dict) and "$ref" in tree:
        return None
    if isinstance(tree, dict) and "$dict" in tree:
        children = [(join(prefix, str(decode_value(k))), v) for k, v in tree["$dict"]]
    else:
        items = tree["$tuple"] if isinstance(tree, dict) else tree
        children = [(join(prefix, str(i)), v) for i, v in enumerate(items)]
    for path, child in children:
        if key == path or key.startswith(path + "/"):
            return subtree(child, path, key)
    return None


ABSENT = object()
"""A placeholder ``resolve`` may return for a leaf to leave out; :func:`prune` drops it."""


def prune(obj: Any) -> Any:
    """``obj`` (from :func:`unflatten`) without :data:`ABSENT` leaves, in dicts, lists, tuples.

    Leaves are returned as they are: a ``torch.Size`` (a tuple subclass) stays a ``torch.Size``.
    """
    if isinstance(obj, dict):
        out = type(obj)()  # not type(obj)(pairs): a Counter would count the pairs
        for k, v in obj.items():
            if v is not ABSENT:
                out[k] = prune(v)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):  # not a subclass: a torch.Size leaf is a value, kept as it is
        items = [prune(v) for v in obj if v is not ABSENT]
        return items if isinstance(obj, list) else tuple(items)
    return obj
