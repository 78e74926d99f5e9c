"""``ckstore://`` checkpoint ids: ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` pick ckstore
from the id alone, as they pick a folder or an fsspec URL.

Forms (``<store>`` is the store's path; ``ckstore+<scheme>://`` names a store at
``<scheme>://...``, e.g. ``ckstore+s3://bucket/prefix/...``)::

    ckstore://<store>/<run>@<step>      save: run and step; load: that ref
    ckstore://<store>/<run>/step-<N>    torchtitan's folder layout: the same as <run>@<N>
    ckstore://<store>/<run>             save: a snapshot of run without a step; load: its latest
    ckstore://<store>/<ref>             load: any ref (a tag, ``run@healthy``, an id prefix)

An absolute local path gives three slashes: ``ckstore:///ckpts/titan@100``. For a local store
that exists, the store is the longest prefix of the path holding a ``ckstore.json`` and the
rest is the ref (so a tag with ``/`` in it is read whole); otherwise the last part is the ref
(the last two for ``<run>/step-<N>``). Importing :mod:`ckstore.dcp` teaches DCP these ids
(:mod:`ckstore.dcp.selection`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..engine.config import CONFIG_NAME
from ..errors import InvalidInputError

SCHEME = "ckstore"
_STEP_DIR = re.compile(r"step[-_](\d+)")
_RUN_STEP = re.compile(r"(?P<run>.+)@(?P<step>\d+)")


@dataclass(frozen=True)
class CheckpointId:
    """A parsed ``ckstore://`` id: the store's URL and the ref in it."""

    store: str
    ref: str

    @property
    def run_step(self) -> tuple[str, int | None]:
        """The ref as a save's run and step (``run@N`` -> ``(run, N)``; else ``(ref, None)``)."""
        m = _RUN_STEP.fullmatch(self.ref)
        return (m["run"], int(m["step"])) if m else (self.ref, None)


def is_ckstore_id(checkpoint_id: Any) -> bool:
    """True for a ``ckstore://`` or ``ckstore+<scheme>://`` checkpoint id."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    text = os.fspath(checkpoint_id)
    return isinstance(text, str) and (
        text.startswith(f"{SCHEME}://") or text.startswith(f"{SCHEME}+")
    )


def parse(checkpoint_id: Any) -> CheckpointId:
    """Split a ``ckstore://`` id into the store's URL and the ref (see the module docstring).

    Raises:
        InvalidInputError: not a ckstore id, or no store or no ref in it.
    """
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if not is_ckstore_id(text) or "://" not in str(text):
        raise InvalidInputError(
            f"{checkpoint_id!r} is not a ckstore checkpoint id (ckstore://<store>/<run>@<step>)"
        )
    scheme, rest = str(text).split("://", 1)
    inner = scheme.split("+", 1)[1] if "+" in scheme else None
    parts = rest.rstrip("/").split("/")
    cut = _store_prefix(parts) if inner is None else None
    if cut is None:
        cut = len(parts) - (2 if len(parts) > 2 and _STEP_DIR.fullmatch(parts[-1]) else 1)
    store, ref_parts = "/".join(parts[:cut]), parts[cut:]
    if len(ref_parts) == 2 and _STEP_DIR.fullmatch(ref_parts[1]):
        ref = f"{ref_parts[0]}@{int(ref_parts[1][5:])}"
    else:
        ref = "/".join(ref_parts)
    if not store or not ref or store == "/":
        raise InvalidInputError(
            f"checkpoint id {text!r} names no store or no snapshot: write "
            "ckstore://<store path>/<run>@<step> (ckstore:///abs/path/run@100 for an absolute path)"
        )
    return CheckpointId(f"{inner}://{store}" if inner else store, ref)


def _store_prefix(parts: list[str]) -> int | None:
    """How many leading parts of a local path are an existing store (the longest), or None."""
    for cut in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:cut]) or "/"
        if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
            return cut
    return None
