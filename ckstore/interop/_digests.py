"""An export's digests: the sidecar written beside its files, per-tensor digests of torch
files, and the check an import runs (docs/FORMAT.md, section 11; the torch-free part and the
verifier are :mod:`ckstore.format.digests` and :mod:`ckstore.format.verify`).

A safetensors file carries its own digests (written by ``_safetensors.write_stream``); every
export also gets ``ckstore-digests.json`` covering each file byte for byte and naming the
tensors of its torch files, so ``ckstore verify`` and an import can tell a damaged tensor
from a damaged file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..engine.view import SnapshotView
from ..format.digests import SIDECAR, VerifyReport, digest, file_digest, sidecar_bytes
from ..format.tensors import byte_view
from ..format.tree import join
from ..format.verify import verify_path
from ._safeload import load_torch


def object_digests(obj: Any, prefix: str = "") -> dict[str, str]:
    """Key path (``model/layer.weight``, list positions as numbers) -> BLAKE3 of the raw bytes
    of every tensor and NumPy array in ``obj`` (nested dicts, lists and tuples)."""
    out: dict[str, str] = {}
    _walk(obj, prefix, out)
    return out


def _walk(obj: Any, key: str, out: dict[str, str]) -> None:
    if isinstance(obj, torch.Tensor):
        out[key] = digest(byte_view(obj.detach().cpu()))
    elif isinstance(obj, np.ndarray):
        out[key] = digest(byte_view(torch.from_numpy(np.ascontiguousarray(obj))))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, join(key, str(k)), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, join(key, str(i)), out)


def torch_file_digests(path: str) -> dict[str, str]:
    """The tensor digests of a ``torch.save`` file (loaded weights-only)."""
    return object_digests(load_torch(path))


def write_sidecar(view: SnapshotView, out: str, tensors: Mapping[str, Mapping[str, str]]) -> str:
    """Write ``ckstore-digests.json`` covering every file under ``out``; returns its name."""
    files = {}
    for d, _dirs, names in os.walk(out):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), out).replace(os.sep, "/")
            if rel != SIDECAR:
                files[rel] = file_digest(os.path.join(d, name))
    about = {"snapshot": view.id, "run": view.run, "step": view.step}
    with open(os.path.join(out, SIDECAR), "wb") as f:
        f.write(sidecar_bytes(files, tensors, about))
    return SIDECAR


def verify_checkpoint(path: str | os.PathLike[str], *, refuse: bool = False) -> VerifyReport:
    """Check a checkpoint against the digests it carries (see :func:`verify_path`).

    With ``refuse`` (what an import does), a checkpoint that carries digests and does not
    match them raises CorruptionError naming the file and tensor, as does a damaged digests
    file, a file it does not list, or a name in it outside the folder; one without any
    digests passes unchecked (``report.files == 0``).
    """
    report = verify_path(os.fspath(path), torch_tensors=torch_file_digests)
    if refuse:
        report.raise_for_problems()
    return report
