"""How a loaded checkpoint object becomes an app_state, and which keys an export selects.

A checkpoint file holds one object. A flat mapping of names to tensors (a model's
``state_dict()``, a safetensors file) becomes the single app ``"model"``; any other mapping with
string keys (``{"model": ..., "optimizer": ..., "epoch": 3}``, a Lightning checkpoint) becomes
one app per top-level key. Export reverses it (see :func:`export_object`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidInputError, UnsupportedValueError
from ..format.tree import escape

SOURCE_APP = "_source"
"""The app an import adds: where the checkpoint came from and the files kept beside it."""
FLAT_APP = "model"
"""The app a flat name -> tensor mapping is imported as."""


class Held:
    """A stateful holding one plain object: ``state_dict()`` returns it, ``load_state_dict`` replaces it."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def is_flat(obj: Any) -> bool:
    """True for a non-empty mapping whose every value is a tensor or array."""
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in obj.values())
    )


def app_state_of(obj: Any, where: str = "the checkpoint") -> dict[str, Held]:
    """The app_state ``import_checkpoint`` takes for a loaded checkpoint object.

    A flat name -> tensor mapping becomes ``{"model": ...}``; a mapping with string keys
    becomes one app per key. Use it to take a file you loaded yourself::

        obj = torch.load(path, weights_only=False)      # only if you trust the file
        store.take(ckstore.interop.app_state_of(obj), run="sft", step=0)

    Raises:
        UnsupportedValueError: ``obj`` is not a mapping, or a top-level key is not a
            non-empty str without '/'.
    """
    if is_flat(obj):
        return {FLAT_APP: Held(obj)}
    if not isinstance(obj, Mapping) or not obj:
        raise UnsupportedValueError(
            f"{where} holds a {type(obj).__name__}, not a non-empty dict; ckstore imports state "
            "dicts. Load it yourself and take a dict of it: store.take({'model': StateDict(...)})"
        )
    for key in obj:
        if not isinstance(key, str) or not key or "/" in key or key == SOURCE_APP:
            raise UnsupportedValueError(
                f"{where}: top-level key {key!r} cannot name an app (it must be a non-empty str "
                f"without '/', other than {SOURCE_APP!r}); load it yourself and take a dict with "
                "other names"
            )
    return {key: Held(value) for key, value in obj.items()}


WEIGHT_APPS = ("model",)
"""App names a weights-only export takes as the model's whatever their tree records."""


def model_apps(apps: Mapping[str, Any]) -> list[str]:
    """The apps of a manifest that hold a model's weights: those stored from an
    ``nn.Module``'s ``state_dict()`` (their tree keeps the module's ``_metadata``, ``"$meta"``)
    or named ``model``. An optimizer's, a scheduler's, RNG state and plain dicts are not."""
    return [
        name
        for name, tree in apps.items()
        if name != SOURCE_APP
        and (name in WEIGHT_APPS or (isinstance(tree, Mapping) and "$meta" in tree))
    ]


def matches(key: str, globs: Sequence[str]) -> bool:
    """True if ``key``, or a path above it, matches one of ``globs`` (fnmatch; ``*`` spans '/')."""
    parts = key.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, g) for g in globs for p in prefixes)


def select(keys: Iterable[str], globs: Sequence[str] | None) -> list[str]:
    """The keys an export writes: all but the import record, narrowed by ``globs`` if given."""
    out = [k for k in keys if k.split("/", 1)[0] != SOURCE_APP]
    if globs:
        out = [k for k in out if matches(k, globs)]
    return out


def unescape(part: str) -> str:
    """Inverse of :func:`ckstore.format.tree.escape`."""
    return part.replace("%2F", "/").replace("%25", "%")


def flat_names(keys: Sequence[str], where: str) -> dict[str, str]:
    """Key -> the tensor name an export writes (safetensors, Hugging Face).

    Keys of one app are named relative to it (``model/encoder.weight`` -> ``encoder.weight``,
    the names the module's ``state_dict()`` has); keys of several apps keep the app
    (``optim/state/0/exp_avg`` -> ``optim.state.0.exp_avg``). Path parts join with '.'.

    Raises:
        InvalidInputError: two keys would get the same name.
    """
    apps = {k.split("/", 1)[0] for k in keys}
    strip = len(apps) == 1
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in keys:
        parts = key.split("/")
        if strip and len(parts) > 1:
            parts = parts[1:]
        name = ".".join(unescape(p) for p in parts)
        if name in seen:
            raise InvalidInputError(
                f"{where}: keys {seen[name]!r} and {key!r} both become tensor name {name!r}; "
                "export fewer keys (--keys) or use --format torch"
            )
        seen[name] = key
        out[key] = name
    return out


def app_key(app: str, name: str) -> str:
    """The ckstore key of entry ``name`` of a flat app."""
    return f"{app}/{escape(name)}"
