"""The ckstore benchmark's entry point (``make bench``); the benchmark is the package
``bench/ckbench`` (see ``ckbench/__init__.py`` for its layout, ``--help`` for the arguments).

    python bench/run.py                  # 2 GiB state, 3 rounds
    python bench/run.py --quick          # 256 MiB state
"""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from ckbench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
