"""What XOR deltas can save at best on the full-training run of ``bench/run.py --only training``.

Trains the same small transformer (AdamW, a save every 10 steps) and, for every later save,
encodes each fp32 tensor of the state (weights and AdamW moments) three ways: whole
(byte-grouped zstd, ckstore's codec), as the better of whole and its XOR against the previous
save (unbounded chains), and as the better of whole and its XOR against the first save (a
keyframe). Prints the stored share of raw per kind of tensor: the floor any delta depth limit
can reach on this state with these codecs.

    python bench/delta_bound.py [--saves 6] [--every 10]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckbench.training_model import TrainConfig, Trainer, fp32_state  # noqa: E402

from ckstore import objects  # noqa: E402


def _flat(prefix: str, x: Any, out: dict[str, bytes]) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            _flat(f"{prefix}/{k}", v, out)
    elif isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() > 1024:
        out[prefix] = x.detach().contiguous().numpy().tobytes()


def _kind(key: str) -> str:
    return (
        "exp_avg_sq"
        if key.endswith("exp_avg_sq")
        else "exp_avg"
        if key.endswith("exp_avg")
        else "weights"
    )


def _stored(raw: bytes, base: bytes | None) -> int:
    whole = len(objects.encode(raw, 4, True)[1])
    if base is None:
        return whole
    xor = np.bitwise_xor(np.frombuffer(raw, np.uint8), np.frombuffer(base, np.uint8)).tobytes()
    return min(whole, len(objects.encode(xor, 4, True)[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)
    trainer = Trainer(TrainConfig())
    saves: list[dict[str, bytes]] = []
    for _ in range(args.saves):
        trainer.steps(args.every)
        flat: dict[str, bytes] = {}
        _flat("", fp32_state(trainer), flat)
        saves.append(flat)
    ways = {
        "whole": lambda i: None,
        "best of whole / XOR previous": lambda i: i - 1,
        "best of whole / XOR first": lambda i: 0,
    }
    print("| encoding | weights | exp_avg | exp_avg_sq | all |\n|---|---|---|---|---|")
    for name, base_of in ways.items():
        tot: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for i in range(1, len(saves)):
            for key, raw in saves[i].items():
                b = base_of(i)
                tot[_kind(key)][0] += _stored(raw, None if b is None else saves[b][key])
                tot[_kind(key)][1] += len(raw)
        cells = [
            f"{100 * tot[k][0] / tot[k][1]:.1f}%" for k in ("weights", "exp_avg", "exp_avg_sq")
        ]
        total = sum(v[0] for v in tot.values()) / sum(v[1] for v in tot.values())
        print(f"| {name} | {' | '.join(cells)} | {100 * total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
