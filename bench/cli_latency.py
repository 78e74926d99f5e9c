"""How long the read commands of the ``ckstore`` command line take on a small store.

    python bench/cli_latency.py [--rounds 5]

Builds a two-snapshot store in a temporary folder, then runs ``log``, ``show``, ``ls``,
``diff``, ``du`` and ``check`` in fresh interpreters and prints the best wall and CPU time of
each, beside ``python -c "import sqlalchemy"`` (the floor every command pays) and
``python -c "import torch"`` (what each command paid before the read path dropped torch).
Timings belong here, not in the tests.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(argv: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import compileall

    import torch

    import ckstore

    # the bytecode an install writes: a command must not compile ckstore's source when it
    # runs from a checkout (under PYTHONDONTWRITEBYTECODE, every time)
    compileall.compile_dir(str(Path(ckstore.__file__).parent), quiet=2)
    root = Path(tempfile.mkdtemp()) / "store"
    with ckstore.open(root, create=True) as store:
        w = torch.arange(1 << 16, dtype=torch.float32)
        store.take({"m": ckstore.StateDict(w=w.clone())}, run="r", step=1)
        w[:10] += 1
        store.take({"m": ckstore.StateDict(w=w)}, run="r", step=2, tags=["best"])
    cli = [sys.executable, "-m", "ckstore.cli", "--store", str(root)]
    cases = {
        "import sqlalchemy": [sys.executable, "-c", "import sqlalchemy"],
        "import torch": [sys.executable, "-c", "import torch"],
        "log": [*cli, "log"],
        "show": [*cli, "show", "best"],
        "ls": [*cli, "ls", "best"],
        "diff": [*cli, "diff", "r@1", "r@2"],
        "du": [*cli, "du"],
        "check": [*cli, "check"],
    }
    print(f"{'command':20s} {'wall s':>8s} {'cpu s':>8s}  (best of {args.rounds})")
    for name, argv in cases.items():
        runs = [_run(argv) for _ in range(args.rounds)]
        print(f"{name:20s} {min(r[0] for r in runs):8.3f} {min(r[1] for r in runs):8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
