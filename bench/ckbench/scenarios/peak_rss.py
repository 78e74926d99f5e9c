"""Peak RSS above the live state of one save and one restore, each in a child process (this
module holds both sides: the parent that spawns, and the measurement the child runs)."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..harness import Bench
from ..states import read_state_file, scramble, write_state_file
from ..systems import SYSTEM_CLASSES
from ..util import BENCH_DIR, fmt_b, proc_status, reset_peak_rss

ENTRY = BENCH_DIR / "run.py"  # the child is the benchmark's own entry point with --child-* args
RESULT_PREFIX = "RESULT "


# ---------------------------------------------------------------------------------------------
# parent


def peak_rss(b: Bench) -> None:
    b.log("peak RSS (save and restore, each in a child process)")
    src = b.work / "rss_state.safetensors"
    write_state_file(b.state, src)
    res: dict[str, Any] = {}
    for n in b.order(0):
        if not b.ok(n):
            continue
        root = b.fresh("rss", n.replace("+", "_"))
        res[n] = system_peaks(b, n, src, root)
        shutil.rmtree(root, ignore_errors=True)
    src.unlink(missing_ok=True)
    b.extra["peak_rss"] = res


def system_peaks(b: Bench, n: str, src: Path, root: Path) -> dict[str, Any]:
    """{op: child result or error} for save, then restore (of what the save wrote)."""
    out: dict[str, Any] = {}
    for op in ("save", "restore"):
        try:
            r = run_child(b, op, n, src, root)
            r["peak_above_live_fraction"] = r["peak_above_live"] / b.state_bytes
            out[op] = r
            b.log(
                f"  {n} {op}: +{fmt_b(r['peak_above_live'])} above the live state "
                f"({r['peak_above_live_fraction']:.0%}), {r['seconds']:.2f} s in child"
            )
        except Exception as exc:  # noqa: BLE001
            out[op] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            b.log(f"  !! {n} {op} RSS child failed: {exc}")
            break
    return out


def run_child(b: Bench, op: str, n: str, src: Path, root: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ENTRY),
        "--child-op",
        op,
        "--child-system",
        n,
        "--child-state",
        str(src),
        "--child-dir",
        str(root),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=b.args.child_timeout)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not line:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"child exited {p.returncode}: {err}")
    result: dict[str, Any] = json.loads(line[-1][len(RESULT_PREFIX) :])
    return result


# ---------------------------------------------------------------------------------------------
# child


def measure(op: str, system: str, state_file: str, directory: str) -> dict[str, Any]:
    """One save (or restore of what a save wrote) of the state in ``state_file`` by ``system``
    into ``directory``, with the peak RSS it reached above the live state."""
    state = read_state_file(state_file)
    gc.collect()
    sys_ = SYSTEM_CLASSES[system]()
    sys_.setup()
    root = Path(directory)
    sys_.prepare(root)
    if op == "restore":
        h = sys_.handle(root, 0)
        scramble(state)
    reset_ok = reset_peak_rss()
    live = proc_status("VmRSS")
    hwm0 = proc_status("VmHWM")
    t0 = time.perf_counter()
    if op == "save":
        sys_.save(state, root, 0)
    else:
        sys_.restore(h, state)
    dt = time.perf_counter() - t0
    hwm = proc_status("VmHWM")
    sys_.close(root)
    base = live if reset_ok else hwm0
    return {
        "live_rss": live,
        "peak_rss": hwm,
        "peak_above_live": max(0, hwm - base),
        "hwm_reset": reset_ok,
        "seconds": dt,
    }


def child_main(op: str, system: str, state_file: str, directory: str) -> int:
    """The child process's entry: measure, then print the result on one RESULT line."""
    print(RESULT_PREFIX + json.dumps(measure(op, system, state_file, directory)), flush=True)
    return 0
