"""Import and export of a checkpoint larger than the memory budget: time and peak memory.

    python bench/interop.py --gib 1 --budget-mib 64

Writes a safetensors file of ``--gib`` GiB (random bf16, 64 MiB tensors), then in fresh
processes: imports it into a new store, exports it as safetensors, torch and DCP, each under
a ``--budget-mib`` memory budget, and for comparison loads and saves it with
``safetensors.torch``. Each step reports wall time and the peak of the process's anonymous
memory (RssAnon, sampled every 5 ms) above its baseline after imports: file-backed pages of
memory-mapped inputs are page cache the kernel can drop, and are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

STEPS = ("import", "export-safetensors", "export-torch", "export-dcp", "safetensors-load+save")


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    return 0


def child(step: str, work: str, budget: int) -> dict[str, float]:
    import torch  # noqa: F401  (baseline includes torch)
    from safetensors.torch import load_file, save_file

    import ckstore

    base = _anon()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    src = os.path.join(work, "big.safetensors")
    store = ckstore.open(os.path.join(work, "store"), create=True)
    store.memory_budget = budget
    if step == "import":
        store.import_checkpoint(src, run="big", step=0)
    elif step.startswith("export-"):
        fmt = step.split("-", 1)[1]
        store.get("big").export(os.path.join(work, f"out-{fmt}"), fmt, force=True)
    else:
        save_file(load_file(src), os.path.join(work, "copy.safetensors"))
    seconds = time.perf_counter() - start
    stop.set()
    peak[0] = max(peak[0], _anon())
    return {"seconds": seconds, "peak_anon_above_baseline": peak[0] - base}


def make_file(path: str, gib: float) -> int:
    import torch
    from safetensors.torch import save_file

    n = max(1, int(gib * 16))  # 64 MiB tensors
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randn(4096, 8192, generator=gen).to(torch.bfloat16)
        for i in range(n)
    }
    save_file(tensors, path)
    return os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--child", nargs=3, metavar=("STEP", "WORK", "BUDGET"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return
    work = tempfile.mkdtemp(prefix="ckstore-interop-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        size = make_file(os.path.join(work, "big.safetensors"), args.gib)
        budget = args.budget_mib << 20
        print(f"file: {size / 2**30:.2f} GiB; memory budget {args.budget_mib} MiB")
        print(f"{'step':<24}{'seconds':>10}{'peak anon MiB':>16}{'/ file':>10}")
        for step in STEPS:
            cmd = [sys.executable, __file__, "--child", step, work, str(budget)]
            out = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            peak = out["peak_anon_above_baseline"]
            print(f"{step:<24}{out['seconds']:>10.2f}{peak / 2**20:>16.0f}{peak / size:>10.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
