"""Which tensors of a take should have changed since the run's previous snapshot.

Three sources, joined:

* **Live parameters** (:func:`trainable_keys`): the app_state's modules, before
  ``state_dict()`` detaches them, say which parameters have ``requires_grad``; when the
  app_state also holds optimizers, only parameters one of them optimizes count (a parameter
  left out of every optimizer is frozen in effect).
* **Optimizer moments** (:func:`optimizer_moments`), recognised in the keys alone, so imports
  and DCP saves have them too: ``.../state/<param>/<moment>`` beside ``.../param_groups``
  (``optim.state.<fqn>.<moment>`` beside ``optim.param_groups`` in a DCP save), for the
  moments every step of torch's optimizers rewrites (:data:`MOMENTS`). ``step`` counters and
  running maxima (``max_exp_avg_sq``) are left out: a maximum may legitimately hold.
* **The caller's globs** (``take(trainable=[...])``), for what neither recognises.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ...format.tree import join

MOMENTS = (
    "exp_avg",
    "exp_avg_sq",
    "momentum_buffer",
    "square_avg",
    "acc_delta",
    "sum",
    "exp_inf",
    "grad_avg",
)
"""Optimizer state that every step with a gradient rewrites (Adam/AdamW/NAdam/RAdam/Adamax,
SGD with momentum, RMSprop, Adadelta, Adagrad)."""

_M = "|".join(MOMENTS)
_SLASHED = re.compile(rf"^(?P<prefix>(?:.*/)?)state/[^/]+/(?:{_M})$")
_DOTTED = re.compile(rf"^(?P<prefix>[^/]+/(?:.*\.)?)state\..+\.(?:{_M})$")


def trainable_keys(app_state: Mapping[str, Any]) -> frozenset[str]:
    """Keys of the live parameters that train (see the module docstring)."""
    import torch

    optimized = {
        id(p)
        for obj in app_state.values()
        if isinstance(obj, torch.optim.Optimizer)
        for group in obj.param_groups
        for p in group.get("params", ())
    }
    keys: set[str] = set()
    for name, obj in app_state.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        for pname, p in obj.named_parameters(remove_duplicate=False):
            if p.requires_grad and (not optimized or id(p) in optimized):
                keys.add(join(name, pname))
    return frozenset(keys)


def optimizer_moments(keys: Iterable[str]) -> set[str]:
    """The keys among ``keys`` that are optimizer moments (see the module docstring)."""
    keys = list(keys)
    groups = _param_group_prefixes(keys)
    found = set()
    for key in keys:
        m = _SLASHED.match(key) or _DOTTED.match(key)
        if m is not None and m["prefix"] in groups:
            found.add(key)
    return found


def _param_group_prefixes(keys: list[str]) -> set[str]:
    """Prefixes ``p`` such that a key ``p + "param_groups"`` (or below it) exists."""
    out = set()
    for key in keys:
        i = key.find("param_groups")
        while i >= 0:
            rest = key[i + len("param_groups") :]
            if not rest or rest[0] in "/.":
                out.add(key[:i])
            i = key.find("param_groups", i + 1)
    return out


def should_change(keys: Iterable[str], live: frozenset[str], globs: Iterable[str]) -> set[str]:
    """The keys among ``keys`` that should change between two saves of a training run."""
    keys = list(keys)
    patterns = list(globs)
    chosen = {k for k in keys if k in live} | optimizer_moments(keys)
    if patterns:
        chosen |= {k for k in keys if any(fnmatch.fnmatchcase(k, g) for g in patterns)}
    return chosen
