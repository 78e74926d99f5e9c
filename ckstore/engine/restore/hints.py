"""What a restore says besides "no": the casts it may make on request and the hint for a
``torch.compile``'d module, whose state dict keys carry the wrapper's ``_orig_mod.`` prefix.
"""

from __future__ import annotations

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
    """The fix when keys differ only by ``_orig_mod.``, else "".

    Args:
        app: The app_state name.
        missing: Destination keys the snapshot lacks.
        unexpected: Snapshot keys the destination lacks.
    """
    # both sides non-empty, the prefix on one side only: a model that gained or lost a key
    # has nothing to pair with, and strict=False is its fix
    strip = {k.replace(COMPILED, "", 1) for k in missing}
    if (
        missing
        and unexpected
        and all(COMPILED in k for k in missing)
        and not any(COMPILED in k for k in unexpected)
        and strip >= set(unexpected)
    ):
        return (
            f"app_state[{app!r}] is a torch.compile'd module (its keys carry {COMPILED!r}) and "
            f"the snapshot was taken from the module itself: restore into {app}._orig_mod (the "
            "module it wraps; compiled code sees the loaded weights)"
        )
    strip = {k.replace(COMPILED, "", 1) for k in unexpected}
    if (
        unexpected
        and missing
        and all(COMPILED in k for k in unexpected)
        and not any(COMPILED in k for k in missing)
        and strip >= set(missing)
    ):
        return (
            f"the snapshot was taken from a torch.compile'd module (its keys carry {COMPILED!r}) "
            f"and app_state[{app!r}] is the plain module: restore into torch.compile(model), or "
            "take model._orig_mod (the module it wraps) so snapshots keep the plain keys"
        )
    return _wrapper_hint(app, missing, unexpected)


WRAPPED = "module."
"""The prefix ``DataParallel`` and ``DistributedDataParallel`` put before every key."""


def _wrapper_hint(app: str, missing: list[str], unexpected: list[str]) -> str:
    """The fix when keys differ only by a ``module.`` prefix (``strict=False`` loads nothing)."""

    def tail(k: str) -> str:
        return k.split("/", 1)[1] if "/" in k else k

    def strip(keys: list[str]) -> set[str]:
        return {k[: len(k) - len(tail(k))] + tail(k)[len(WRAPPED) :] for k in keys}

    # both sides non-empty: a key missing under a real submodule named ``module`` (or a DDP
    # model whose snapshot lacks one buffer) has nothing unexpected to pair with
    if (
        missing
        and unexpected
        and all(tail(k).startswith(WRAPPED) for k in missing)
        and not any(tail(k).startswith(WRAPPED) for k in unexpected)
        and (strip(missing) >= set(unexpected))
    ):
        return (
            f"app_state[{app!r}] is wrapped (DataParallel/DistributedDataParallel: its keys carry "
            f"{WRAPPED!r}) and the snapshot was taken from the module itself: restore into "
            f"{app}.module (strict=False would load nothing)"
        )
    if (
        unexpected
        and missing
        and all(tail(k).startswith(WRAPPED) for k in unexpected)
        and not any(tail(k).startswith(WRAPPED) for k in missing)
        and (strip(unexpected) >= set(missing))
    ):
        return (
            f"the snapshot was taken from a DataParallel/DistributedDataParallel module (its keys "
            f"carry {WRAPPED!r}) and app_state[{app!r}] is the plain module: restore into the "
            "wrapped model, or take model.module so snapshots keep the plain keys (strict=False "
            "would load nothing)"
        )
    return ""
