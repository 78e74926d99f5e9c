"""The trainers' non-plain values as plain data, and back.

A Lightning checkpoint holds what the user's code put in it: hyper-parameters saved from an
OmegaConf ``DictConfig`` (the Hydra and LightningCLI norm) with its type, ``pathlib`` paths,
``argparse.Namespace`` objects, ``Enum`` members. ckstore stores plain data only (no pickle),
so :func:`to_plain` turns each of these into a small dict marked with :data:`MARK`, which
:func:`from_plain` turns back. Nothing read back names code to run: a path, a namespace and an
OmegaConf container are rebuilt by fixed constructors; a type by a fixed table; an ``Enum``
member only from a class already imported in this process (looked up, never imported), else
it stays its plain value. Anything else is left for the store, which refuses what it cannot
hold with an error naming the key.
"""

from __future__ import annotations

import argparse
import enum
import pathlib
import sys
from collections.abc import Callable
from typing import Any

MARK = "__ckstore_value__"
"""The key of a marked dict: ``{MARK: kind, ...}`` (one such dict per converted value)."""

_PATHS: dict[str, Callable[[str], pathlib.PurePath]] = {
    cls.__name__: cls
    for cls in (
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    )
}
_TYPES = {"dict": dict, "Namespace": argparse.Namespace}
"""Types a checkpoint may name as a value (Lightning's ``hparams_type``), besides OmegaConf's."""


def _omegaconf() -> Any:
    """The ``omegaconf`` module if this process imported it (an OmegaConf value exists only
    then), else None."""
    return sys.modules.get("omegaconf")


def to_plain(obj: Any) -> Any:
    """``obj`` with every path, namespace, enum member, OmegaConf container and known type in
    it replaced by a marked dict (containers copied only where something changed)."""
    om = _omegaconf()
    if om is not None and isinstance(obj, om.Container):
        kind = "DictConfig" if isinstance(obj, om.DictConfig) else "ListConfig"
        return {MARK: "omegaconf", "type": kind, "value": om.OmegaConf.to_container(obj)}
    if isinstance(obj, enum.Enum):
        cls = type(obj)
        return {
            MARK: "enum",
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "name": obj.name,
            "value": to_plain(obj.value),
        }
    if isinstance(obj, pathlib.PurePath):
        return {MARK: "path", "type": type(obj).__name__, "value": str(obj)}
    if isinstance(obj, argparse.Namespace):
        return {MARK: "namespace", "value": to_plain(vars(obj))}
    if isinstance(obj, type):
        name = _type_name(obj)
        return {MARK: "type", "name": name} if name is not None else obj
    if isinstance(obj, dict):
        items = [(k, to_plain(v)) for k, v in obj.items()]
        if all(v is obj[k] for k, v in items):
            return obj
        return dict(items)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        values = [to_plain(v) for v in obj]
        if all(a is b for a, b in zip(values, obj)):
            return obj
        return values if isinstance(obj, list) else tuple(values)
    return obj


def _type_name(cls: type) -> str | None:
    om = _omegaconf()
    if om is not None and cls in (om.DictConfig, om.ListConfig):
        return f"omegaconf.{cls.__name__}"
    for name, known in _TYPES.items():
        if cls is known:
            return name
    if issubclass(cls, dict) and cls.__name__ == "AttributeDict":
        return "dict"  # Lightning's: it rebuilds its own AttributeDict from a plain dict
    return None


def from_plain(obj: Any) -> Any:
    """The inverse of :func:`to_plain` (containers rebuilt only where something is marked)."""
    if isinstance(obj, dict):
        kind = obj.get(MARK)
        if isinstance(kind, str):
            return _unmark(kind, obj)
        items = [(k, from_plain(v)) for k, v in obj.items()]
        if all(v is obj[k] for k, v in items):
            return obj
        out = type(obj)()  # not type(obj)(items): a Counter would count the pairs
        for k, v in items:
            out[k] = v
        return out
    if isinstance(obj, (list, tuple)):
        values = [from_plain(v) for v in obj]
        if all(a is b for a, b in zip(values, obj)):
            return obj
        return values if isinstance(obj, list) else tuple(values)
    return obj


def _unmark(kind: str, obj: dict[str, Any]) -> Any:
    if kind == "path":
        return _PATHS.get(str(obj.get("type")), pathlib.PurePath)(str(obj["value"]))
    if kind == "namespace":
        return argparse.Namespace(**from_plain(obj["value"]))
    if kind == "enum":
        return _enum_member(str(obj["class"]), str(obj["name"]), from_plain(obj["value"]))
    if kind == "omegaconf":
        om = _omegaconf_for_reading()
        value = from_plain(obj["value"])
        return om.OmegaConf.create(value) if om is not None else value
    if kind == "type":
        return _named_type(str(obj["name"]))
    return obj


def _omegaconf_for_reading() -> Any:
    """omegaconf (imported by its fixed name when installed), or None: the value stays plain."""
    try:
        import omegaconf
    except ImportError:
        return None
    return omegaconf


def _named_type(name: str) -> Any:
    if name.startswith("omegaconf."):
        om = _omegaconf_for_reading()
        cls = getattr(om, name.split(".", 1)[1], None) if om is not None else None
        return cls if cls is not None else dict
    return _TYPES.get(name, dict)


def _enum_member(qualified: str, name: str, value: Any) -> Any:
    """The member ``name`` of enum class ``qualified`` if that class is already imported in this
    process (its module is looked up in ``sys.modules``, never imported), else ``value``."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest module name first
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        found: Any = module
        for part in parts[cut:]:
            found = vars(found).get(part) if hasattr(found, "__dict__") else None
        if isinstance(found, type) and issubclass(found, enum.Enum):
            return found.__members__.get(name, value)
        return value
    return value
