"""Bytes on disk over ``--saves`` successive saves, 10% of the state changed between saves; every
system sees the same sequence of states."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch

from ..harness import Bench
from ..states import mutate, trainable_tensors
from ..util import dir_bytes, fmt_b


def bytes_over_saves(b: Bench) -> None:
    n_saves = b.args.saves
    b.log(f"bytes on disk over {n_saves} saves (10% changed between saves)")
    saved = {k: [t.clone() for t in trainable_tensors(b.state, k)] for k in b.trainable}
    curves: dict[str, list[int]] = {}
    for n in b.order(0):
        if not b.ok(n):
            continue
        rewind(b, saved)
        root = b.fresh("bytes", n.replace("+", "_"))
        try:
            b.systems[n].prepare(root)
        except Exception as exc:  # noqa: BLE001
            b.fail(n, "prepare", exc)
            continue
        curve = save_curve(b, n, root, n_saves)
        if len(curve) == n_saves:
            curves[n] = curve
            b.log(f"  {n}: {' -> '.join(fmt_b(x) for x in curve)}")
            compact_all = getattr(b.systems[n], "compact_all", None)
            if compact_all is not None and compact_all(root):  # the newest snapshot packed too
                b.extra.setdefault("bytes_compacted", {})[n] = dir_bytes(root)
        try:
            b.systems[n].close(root)
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(root, ignore_errors=True)
    b.extra["bytes_curves"] = curves


def rewind(b: Bench, saved: dict[str, list[torch.Tensor]]) -> None:
    """Put the trainable params and their Adam state back to where the scenario started."""
    for k, ts in saved.items():
        for dst, src in zip(trainable_tensors(b.state, k), ts):
            dst.copy_(src)


def save_curve(b: Bench, n: str, root: Path, n_saves: int) -> list[int]:
    """Bytes under ``root`` after each save; shorter than ``n_saves`` when a save failed."""
    curve = []
    for i in range(n_saves):
        if i:
            mutate(b.state, b.trainable, seed=5000 + i)
        h = b.timed("bytes_phase_save", n, partial(b.systems[n].save, b.state, root, i))
        if h is None:
            break
        b.systems[n].settle(root)  # what the disk holds once ckstore's compaction is done
        curve.append(dir_bytes(root))
    return curve
