"""What a restore says besides "no": the casts it may make on request and the hint for a
``torch.compile``'d module, whose state dict keys carry the wrapper's ``_orig_mod.`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...format.tensors import NO_COPY_KERNEL

COMPILED = "_orig_mod."
"""The prefix ``torch.compile``'s ``OptimizedModule`` puts before every key of the module it
wraps."""


def castable(dest: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether ``restore(cast=True)`` converts a stored ``stored`` tensor into ``dest``: both
    floating point (float32, bfloat16, float16, float64, the float8 kinds; not the packed
    ``float4_e2m1fn_x2``, which torch converts nothing to or from) and not the same dtype.
    Integers, booleans and complex numbers are never converted: a step counter or a mask that
    changed type is a mistake, not a precision choice."""
    return (
        dest.dtype != stored
        and dest.is_floating_point()
        and stored.is_floating_point
        and dest.dtype not in NO_COPY_KERNEL  # packed fp4: torch converts nothing to or from it
        and stored not in NO_COPY_KERNEL
    )


def compiled_hint(app: str, missing: list[str], unexpected: list[str]) -> str:
    """The fix when keys differ only by ``_orig_mod.`` (``torch.compile``) or by ``module.``
    (DataParallel), else "" (and the caller's advice, ``strict=False``, stands).

    Args:
        app: The app_state name.
        missing: Destination keys the snapshot lacks.
        unexpected: Snapshot keys the destination lacks.
    """
    compiled = _Prefix(lambda k: COMPILED in k, lambda k: k.replace(COMPILED, "", 1))
    if compiled.whole_difference(missing, unexpected):
        return (
            f"app_state[{app!r}] is a torch.compile'd module (its keys carry {COMPILED!r}) and "
            f"the snapshot was taken from the module itself: restore into {app}._orig_mod (the "
            "module it wraps; compiled code sees the loaded weights)"
        )
    if compiled.whole_difference(unexpected, missing):
        return (
            f"the snapshot was taken from a torch.compile'd module (its keys carry {COMPILED!r}) "
            f"and app_state[{app!r}] is the plain module: restore into torch.compile(model), or "
            "take model._orig_mod (the module it wraps) so snapshots keep the plain keys"
        )
    wrapped = _Prefix(lambda k: _tail(k).startswith(WRAPPED), _unwrapped)
    if wrapped.whole_difference(missing, unexpected):
        return (
            f"app_state[{app!r}] is wrapped (DataParallel/DistributedDataParallel: its keys carry "
            f"{WRAPPED!r}) and the snapshot was taken from the module itself: restore into "
            f"{app}.module (strict=False would load nothing)"
        )
    if wrapped.whole_difference(unexpected, missing):
        return (
            f"the snapshot was taken from a DataParallel/DistributedDataParallel module (its keys "
            f"carry {WRAPPED!r}) and app_state[{app!r}] is the plain module: restore into the "
            "wrapped model, or take model.module so snapshots keep the plain keys (strict=False "
            "would load nothing)"
        )
    return ""


WRAPPED = "module."
"""The prefix ``DataParallel`` and ``DistributedDataParallel`` put before every key."""


class _Prefix:
    """A wrapper's mark on a key (``has``) and the key without it (``strip``)."""

    def __init__(self, has: Callable[[str], bool], strip: Callable[[str], str]) -> None:
        self.has, self.strip = has, strip

    def whole_difference(self, marked: list[str], plain: list[str]) -> bool:
        """Whether the keys differ by this prefix alone: every key of ``marked`` carries it,
        none of ``plain`` does, and ``marked`` without it covers ``plain``. Both must be
        non-empty: a model that only gained or lost a key has nothing to pair with."""
        return bool(
            marked
            and plain
            and all(self.has(k) for k in marked)
            and not any(self.has(k) for k in plain)
            and {self.strip(k) for k in marked} >= set(plain)
        )


def _tail(key: str) -> str:
    """The key within its app (after ``app/``)."""
    return key.split("/", 1)[1] if "/" in key else key


def _unwrapped(key: str) -> str:
    tail = _tail(key)
    return key[: len(key) - len(tail)] + tail[len(WRAPPED) :]
