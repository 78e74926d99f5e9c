"""The guard on CUDA tensors (a machine with a GPU): a take copies device chunks into pinned
host buffers (``engine/device_stage``) and the guard measures those, so the figures must be
the same as for the same state on the CPU. Then take time with health on and off for a state
on the GPU, side by side.

    python bench/guard_gpu.py                 # needs torch with CUDA
    python bench/guard_gpu.py --size-mb 2048 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

import ckstore


def check(tmp: str) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(3000, 700, generator=gen) for i in range(4)}
    state["b16"] = torch.randn(5000, 300, generator=gen).bfloat16()
    state["w1"][123, 45] = float("nan")
    state["w2"][-1, -1] = float("inf")
    state["b16"][7, 7] = float("-inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = ckstore.open(f"{tmp}/check", create=True, chunk_bytes=1 << 20)
        cpu = store.take({"m": ckstore.StateDict(state)}, run="cpu", step=1, on_nonfinite="ignore")
        gpu = store.take(
            {"m": ckstore.StateDict({k: v.cuda() for k, v in state.items()})},
            run="gpu",
            step=1,
            on_nonfinite="ignore",
        )
    hc, hg = cpu.health.tensors, gpu.health.tensors  # type: ignore[union-attr]
    assert hc == hg, (hc, hg)
    assert (hg["m/w1"].nan, hg["m/w2"].inf, hg["m/b16"].inf) == (
        1,
        1,
        1,
    ) and gpu.record.nonfinite == 3
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.take({"model": model, "optim": opt}, run="train", step=1)
        stale = store.take({"model": model, "optim": opt}, run="train", step=2)  # no step between
    assert set(stale.health.stale or ()) >= {"model/weight", "model/bias"}, stale.health  # type: ignore[union-attr]
    assert any("did not change since step 1" in str(w.message) for w in caught)
    print(
        f"CUDA: figures equal the CPU's for {len(hg)} tensors; NaN/Inf found: {gpu.record.nonfinite}; "
        f"stale on CUDA parameters: {len(stale.health.stale or ())} keys"
    )  # type: ignore[union-attr]


def bench(tmp: str, size_mb: int, rounds: int) -> None:
    n = (size_mb << 20) // 4 // 4096
    gen = torch.Generator(device="cuda").manual_seed(1)
    state = {
        f"layer{i}": torch.randn(n // 16, 4096, device="cuda", generator=gen) for i in range(16)
    }
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for health in (True, False) if r % 2 == 0 else (False, True):
            store = ckstore.open(f"{tmp}/b-{r}-{health}", create=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            store.take({"m": ckstore.StateDict(state)}, run="r", step=1, health=health)
            times[health].append(time.perf_counter() - t0)
            store.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"CUDA state {size_mb} MiB, first take: health on {on:.2f} s, off {off:.2f} s ({100 * (on - off) / off:+.1f}%)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to check here")
    with tempfile.TemporaryDirectory(prefix="ckstore-guard-gpu-") as tmp:
        check(tmp)
        bench(tmp, args.size_mb, args.rounds)


if __name__ == "__main__":
    main()
