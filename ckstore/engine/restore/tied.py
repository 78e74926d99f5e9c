"""Tied weights of a module built on the meta device: one tensor under several keys.

A restore into meta parameters assigns new tensors (``load_state_dict(assign=True)``); two keys
that name one parameter (an embedding tied to the output head) must get one tensor, as they do
from ``torch.load``'s state dict, or the first optimizer step makes them differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def tied_keys(
    meta: Iterable[str], own: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> dict[str, str]:
    """Keys of ``meta`` whose module tensor (``own``: key -> the module's parameter or buffer)
    is the same object as an earlier key's, and whose stored bytes (``tensors``) are the
    same -> that earlier key. Keys tied in the module but stored with other bytes (a snapshot
    of an untied model) stay apart, as ``load_state_dict`` leaves them."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key in meta:
        o = own.get(key)
        if o is None or key not in tensors:
            continue
        k0 = first.setdefault(id(o), key)
        if k0 != key and k0 in tensors and _same_bytes(tensors[k0], tensors[key]):
            tied[key] = k0
    return tied


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same tensor (NaNs included, which ``torch.equal`` calls unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
